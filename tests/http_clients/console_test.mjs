// Drives the web console (server/http/console_page.h) in headless Debian chromium through
// puppeteer-core: loads it, enters the API key, creates a session, sends a message and sees the
// streamed reply and the live figures, then forks the session. Run by run_test.sh.
//
//   node console_test.mjs ORIGIN API_KEY CHROMIUM [SCREENSHOT.png]   (ORIGIN: http://host:port)
import assert from 'node:assert/strict';
import puppeteer from 'puppeteer-core';

const [origin, apiKey, chromium, screenshot] = process.argv.slice(2);

// page.waitForFunction that, when it times out, says what the page showed instead.
// `condition` runs in the page: it sees `args`, not this file's variables.
async function waitOrExplain(page, errors, what, condition, ...args) {
  try {
    await page.waitForFunction(condition, {}, ...args);
  } catch (e) {
    const shown = await page.evaluate(() => ({
      where: document.getElementById('where').textContent,
      sessions: [...document.querySelectorAll('#sessions li')].map(
          (li) => li.dataset.id + (li.className ? ` (${li.className})` : '')),
      position: document.getElementById('f-pos').textContent,
      errors: [...document.querySelectorAll('.msg.error')].map((m) => m.textContent),
    }));
    throw new Error(`waiting for ${what}: ${e.message}; the page shows ${JSON.stringify(shown)}, ` +
                    `page errors ${JSON.stringify(errors)}`);
  }
}
const browser = await puppeteer.launch({
  executablePath: chromium,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
try {
  const page = await browser.newPage();
  // Generous: a loaded CI machine runs this beside other servers; nothing here measures time.
  page.setDefaultTimeout(180_000);
  await page.setViewport({ width: 1200, height: 720 });
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(`${origin}/`, { waitUntil: 'load' });
  await page.type('#apikey', apiKey);
  await page.$eval('#apikey', (e) => e.dispatchEvent(new Event('change')));
  await waitOrExplain(page, errors, 'the model name',
                      () => document.getElementById('f-model').textContent !== '-');

  // A session, then one turn in it.
  await page.type('#newid', 'console');
  await page.click('#create');
  await waitOrExplain(page, errors, 'the new session selected',
                      () => document.getElementById('where').textContent === 'session console');
  await page.type('#prompt', 'Hello from the console');
  await page.$eval('#max_tokens', (e) => { e.value = '24'; });
  await page.click('#go');
  await waitOrExplain(page, errors, 'the streamed reply', () => {
    const replies = document.querySelectorAll('.msg.assistant');
    return replies.length === 1 && replies[0].querySelector('.meta') !== null;
  });
  const reply = await page.$eval('.msg.assistant', (e) => e.firstChild ? e.firstChild.textContent : '');
  assert.ok(reply.length > 0, 'no streamed text');
  assert.equal(await page.$$eval('.msg.error', (e) => e.length), 0);
  await waitOrExplain(page, errors, 'the position after the turn',
                      () => Number(document.getElementById('f-pos').textContent) > 0);
  const tokens = Number(await page.$eval('#f-tokens', (e) => e.textContent));
  assert.ok(tokens >= 1 && tokens <= 24, `tokens ${tokens}`);
  assert.match(await page.$eval('#f-ttft', (e) => e.textContent), /^\d+ ms$/);
  assert.match(await page.$eval('#f-bytes', (e) => e.textContent), /B$/);

  // Fork it: the copy becomes the current session, at the same position. The list may hold other
  // sessions of this key (sdk_test.mjs leaves one), so it is counted, not assumed. The fork is
  // drawn once a refresh started after it has finished: then its row is the active one, and the
  // figures beside it are its own (a refresh draws the list and the figures together).
  const position = await page.$eval('#f-pos', (e) => e.textContent);
  const listed = await page.$$eval('#sessions li', (e) => e.length);
  await page.click('#sessions li[data-id="console"] button.fork');
  await waitOrExplain(page, errors, 'the fork drawn as the current session', () => {
    const where = document.getElementById('where').textContent;
    if (!where.startsWith('session ') || where === 'session console') return false;
    const active = document.querySelector('#sessions li.active');
    return active !== null && where === 'session ' + active.dataset.id;
  });
  assert.equal(await page.$$eval('#sessions li', (e) => e.length), listed + 1);
  assert.equal(await page.$eval('#f-pos', (e) => e.textContent), position);
  // One more turn on the fork, for the screenshot.
  await page.type('#prompt', 'And a reply on the fork');
  await page.click('#go');
  await waitOrExplain(page, errors, 'the streamed reply', () => {
    const replies = document.querySelectorAll('.msg.assistant');
    return replies.length === 1 && replies[0].querySelector('.meta') !== null;
  });
  await waitOrExplain(page, errors, 'the position after the turn on the fork',
                      (before) => Number(document.getElementById('f-pos').textContent) > Number(before),
                      position);
  assert.deepEqual(errors, []);
  if (screenshot) await page.screenshot({ path: screenshot });
  console.log(`console: reply of ${tokens} tokens streamed, session forked at position ${position}`);
} finally {
  await browser.close();
}
