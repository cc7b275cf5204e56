// Drives the web console (server/http/console_page.h) in headless Debian chromium through
// puppeteer-core: loads it, enters the API key, creates a session, sends a message and sees the
// streamed reply and the live figures, then forks the session. Run by run_test.sh.
//
//   node console_test.mjs ORIGIN API_KEY CHROMIUM [SCREENSHOT.png]   (ORIGIN: http://host:port)
import assert from 'node:assert/strict';
import puppeteer from 'puppeteer-core';

const [origin, apiKey, chromium, screenshot] = process.argv.slice(2);
const browser = await puppeteer.launch({
  executablePath: chromium,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1200, height: 720 });
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(`${origin}/`, { waitUntil: 'load' });
  await page.type('#apikey', apiKey);
  await page.$eval('#apikey', (e) => e.dispatchEvent(new Event('change')));
  await page.waitForFunction(() => document.getElementById('f-model').textContent !== '-');

  // A session, then one turn in it.
  await page.type('#newid', 'console');
  await page.click('#create');
  await page.waitForFunction(() => document.getElementById('where').textContent === 'session console');
  await page.type('#prompt', 'Hello from the console');
  await page.$eval('#max_tokens', (e) => { e.value = '24'; });
  await page.click('#go');
  await page.waitForFunction(() => {
    const replies = document.querySelectorAll('.msg.assistant');
    return replies.length === 1 && replies[0].querySelector('.meta') !== null;
  }, { timeout: 60_000 });
  const reply = await page.$eval('.msg.assistant', (e) => e.firstChild ? e.firstChild.textContent : '');
  assert.ok(reply.length > 0, 'no streamed text');
  assert.equal(await page.$$eval('.msg.error', (e) => e.length), 0);
  await page.waitForFunction(() => Number(document.getElementById('f-pos').textContent) > 0);
  const tokens = Number(await page.$eval('#f-tokens', (e) => e.textContent));
  assert.ok(tokens >= 1 && tokens <= 24, `tokens ${tokens}`);
  assert.match(await page.$eval('#f-ttft', (e) => e.textContent), /^\d+ ms$/);
  assert.match(await page.$eval('#f-bytes', (e) => e.textContent), /B$/);

  // Fork it: the copy becomes the current session, at the same position.
  const position = await page.$eval('#f-pos', (e) => e.textContent);
  await page.click('#sessions li[data-id="console"] button.fork');
  await page.waitForFunction(
      () => document.querySelectorAll('#sessions li').length === 2 &&
            document.getElementById('where').textContent.startsWith('session ') &&
            document.getElementById('where').textContent !== 'session console' &&
            document.getElementById('f-pos').textContent !== '-');
  assert.equal(await page.$eval('#f-pos', (e) => e.textContent), position);
  // One more turn on the fork, for the screenshot.
  await page.type('#prompt', 'And a reply on the fork');
  await page.click('#go');
  await page.waitForFunction(() => {
    const replies = document.querySelectorAll('.msg.assistant');
    return replies.length === 1 && replies[0].querySelector('.meta') !== null;
  }, { timeout: 60_000 });
  await page.waitForFunction(
      (before) => Number(document.getElementById('f-pos').textContent) > Number(before), {},
      position);
  assert.deepEqual(errors, []);
  if (screenshot) await page.screenshot({ path: screenshot });
  console.log(`console: reply of ${tokens} tokens streamed, session forked at position ${position}`);
} finally {
  await browser.close();
}
