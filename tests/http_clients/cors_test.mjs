// A browser calling the HTTP API from another origin (CORS, --http_cors_origins), in headless
// Debian chromium through puppeteer-core: a page from the allowed origin gets a chat completion,
// whole and streamed (the browser's preflight for the Authorization header and the JSON body must
// pass); a page from an origin not allowed is refused by the browser. Run by run_test.sh, whose
// server allows http://127.0.0.1:PAGE_PORT only.
//
//   node cors_test.mjs API_BASE API_KEY CHROMIUM PAGE_PORT   (API_BASE: http://host:port/v1)
import assert from 'node:assert/strict';
import http from 'node:http';
import puppeteer from 'puppeteer-core';

const [apiBase, apiKey, chromium, pagePort] = process.argv.slice(2);

// The pages' own server: a blank page, so that the fetches run with its origin.
const pages = http.createServer((req, res) => {
  res.writeHead(200, { 'Content-Type': 'text/html' });
  res.end('<!doctype html><title>cors</title>');
});
await new Promise((resolve) => pages.listen(Number(pagePort), '127.0.0.1', resolve));

// In the page: a chat completion, whole or streamed; what came back, or the error's name.
async function callFrom(page, stream) {
  return page.evaluate(async (base, key, stream) => {
    try {
      const res = await fetch(`${base}/chat/completions`, {
        method: 'POST',
        headers: { Authorization: `Bearer ${key}`, 'Content-Type': 'application/json' },
        body: JSON.stringify({
          messages: [{ role: 'user', content: 'Hi' }], max_tokens: 4, temperature: 0, stream,
        }),
      });
      return { status: res.status, body: await res.text() };
    } catch (e) {
      return { error: e.name };
    }
  }, apiBase, apiKey, stream);
}

const browser = await puppeteer.launch({
  executablePath: chromium,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
try {
  const page = await browser.newPage();
  page.setDefaultTimeout(180_000);  // a loaded CI machine; nothing here measures time

  await page.goto(`http://127.0.0.1:${pagePort}/`, { waitUntil: 'load' });
  const whole = await callFrom(page, false);
  assert.equal(whole.status, 200, JSON.stringify(whole));
  assert.equal(JSON.parse(whole.body).object, 'chat.completion');
  const streamed = await callFrom(page, true);
  assert.equal(streamed.status, 200, JSON.stringify(streamed));
  assert.match(streamed.body, /data: \[DONE\]/);

  // Another origin (the host's name instead of its address): the browser refuses to hand the
  // page the answer.
  await page.goto(`http://localhost:${pagePort}/`, { waitUntil: 'load' });
  const refused = await callFrom(page, false);
  assert.equal(refused.error, 'TypeError', JSON.stringify(refused));
  console.log('cors: the allowed origin is served, whole and streamed; another is refused');
} finally {
  await browser.close();
  pages.close();
}
