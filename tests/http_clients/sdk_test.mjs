// Drives sdm-server's OpenAI-compatible HTTP API (docs/api.md, "HTTP API") with the official
// `openai` npm SDK: streamed chat completions and completions, with and without a session,
// usage, log-probabilities, and errors the SDK maps to its typed errors. Run by run_test.sh.
//
//   node sdk_test.mjs BASE_URL API_KEY      (BASE_URL like http://127.0.0.1:PORT/v1)
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60_000 });

async function collect(stream, chat) {
  let text = '';
  let usage = null;
  let finish = null;
  let session = null;
  let chunks = 0;
  for await (const chunk of stream) {
    ++chunks;
    if (chunk.usage) usage = chunk.usage;
    if (chunk.choices.length === 0) continue;
    const choice = chunk.choices[0];
    text += chat ? (choice.delta.content ?? '') : choice.text;
    if (choice.finish_reason) {
      finish = choice.finish_reason;
      session = chunk.session ?? null;
    }
  }
  return { text, usage, finish, session, chunks };
}

const models = await client.models.list();
const model = models.data[0].id;
assert.ok(model.length > 0);

// A chat completion, streamed and whole (greedy: the same text).
const messages = [{ role: 'user', content: 'Hello there' }];
const streamed = await collect(
  await client.chat.completions.create({
    model, messages, max_tokens: 8, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  }),
  true);
assert.ok(['stop', 'length'].includes(streamed.finish), streamed.finish);
assert.ok(streamed.usage.completion_tokens >= 1 && streamed.usage.completion_tokens <= 8);
assert.equal(streamed.usage.total_tokens,
             streamed.usage.prompt_tokens + streamed.usage.completion_tokens);
const whole = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 0 });
assert.equal(whole.choices[0].message.content, streamed.text);
assert.equal(whole.usage.completion_tokens, streamed.usage.completion_tokens);
console.log(`chat stream: ${streamed.chunks} chunks, usage ${JSON.stringify(streamed.usage)}`);

// Log-probabilities as the SDK types them: one content entry per generated token, the
// alternatives most probable first; streamed, the same entries.
const withLogprobs = await client.chat.completions.create({
  model, messages, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3,
});
const content = withLogprobs.choices[0].logprobs.content;
assert.equal(content.length, withLogprobs.usage.completion_tokens);
// The tokens' bytes spell the reply (past it only a stop string's; an EOS has none).
assert.ok(Buffer.from(content.flatMap((e) => e.bytes)).toString()
  .startsWith(withLogprobs.choices[0].message.content));
for (const entry of content) {
  assert.ok(entry.logprob <= 0);
  assert.equal(entry.top_logprobs.length, 3);
  assert.equal(entry.top_logprobs[0].logprob, entry.logprob);  // greedy: the most probable
}
const streamedContent = [];
for await (const chunk of await client.chat.completions.create({
  model, messages, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3, stream: true,
})) {
  streamedContent.push(...(chunk.choices[0]?.logprobs?.content ?? []));
}
assert.deepEqual(streamedContent, content);
const legacy = await client.completions.create({
  model, prompt: 'Once upon a time', max_tokens: 6, temperature: 0, logprobs: 2,
});
assert.equal(legacy.choices[0].logprobs.token_logprobs.length, 6);
assert.equal(legacy.choices[0].logprobs.top_logprobs[0] !== null, true);
// Scoring a text (an evaluation harness's loglikelihood): echo with logprobs returns the prompt's
// tokens first, the first with nothing before it (null), then the generated token.
const scored = await client.completions.create({
  model, prompt: 'Once upon a time', max_tokens: 1, temperature: 0, logprobs: 1, echo: true,
});
const scoredLp = scored.choices[0].logprobs;
assert.equal(scored.choices[0].text.startsWith('Once upon a time'), true);
assert.equal(scoredLp.token_logprobs.length, scored.usage.prompt_tokens + 1);
assert.equal(scoredLp.token_logprobs[0], null);
for (const lp of scoredLp.token_logprobs.slice(1)) assert.equal(lp <= 0, true);
assert.equal(scoredLp.token_logprobs.at(-1), legacy.choices[0].logprobs.token_logprobs[0]);
console.log(`logprobs: ${content.map((e) => e.logprob.toFixed(3)).join(' ')}`);

// A completion, streamed.
const completion = await collect(
  await client.completions.create({
    model, prompt: 'Once upon a time', max_tokens: 6, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  }),
  false);
assert.equal(completion.finish, 'length');
assert.equal(completion.usage.completion_tokens, 6);
const completionWhole =
    await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 6, temperature: 0 });
assert.equal(completionWhole.choices[0].text, completion.text);

// With a session: the second turn sends only its new message; the state carries the first.
const sessionId = `node-${Date.now()}`;
const created = await client.post('/sessions', { body: { session_id: sessionId } });
assert.equal(created.id, sessionId);
assert.equal(created.position, 0);
const turn1 = await collect(
  await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'My name is Ada.' }], max_tokens: 6,
    temperature: 0, stream: true, stream_options: { include_usage: true }, session_id: sessionId,
  }),
  true);
const afterTurn1 = await client.get(`/sessions/${sessionId}`);
assert.equal(turn1.session.position, afterTurn1.position);
assert.equal(afterTurn1.position, turn1.usage.prompt_tokens + turn1.usage.completion_tokens);
const turn2 = await collect(
  await client.completions.create({
    model, prompt: ' And then', max_tokens: 4, temperature: 0, stream: true,
    stream_options: { include_usage: true }, session_id: sessionId,
  }),
  false);
assert.equal(turn2.usage.history_tokens, afterTurn1.position);
const listed = await client.get('/sessions');
assert.ok(listed.data.some((s) => s.id === sessionId));
const forked = await client.post(`/sessions/${sessionId}/fork`, { body: {} });
assert.equal(forked.position, turn2.session.position);
await client.delete(`/sessions/${forked.id}`);
console.log(`session ${sessionId}: position ${turn2.session.position}`);

// Errors reach the SDK as its typed errors.
await assert.rejects(
  client.chat.completions.create({ model: 'no-such-model', messages, max_tokens: 2 }),
  (e) => e instanceof OpenAI.NotFoundError && e.status === 404);
await assert.rejects(
  client.chat.completions.create({ model, messages, max_tokens: 2, n: 65 }),
  (e) => e instanceof OpenAI.BadRequestError && /'n' must be in \[1, 64\]/.test(e.message));
// Several choices: n per prompt, and a batch of prompts, each choice with its index.
const two = await client.chat.completions.create({ model, messages, max_tokens: 3, n: 2, seed: 5 });
assert.deepEqual(two.choices.map((c) => c.index), [0, 1]);
const batch = await client.completions.create({
  model, prompt: ['Once upon', 'Hello'], max_tokens: 3, temperature: 0,
});
assert.deepEqual(batch.choices.map((c) => c.index), [0, 1]);
await assert.rejects(
  new OpenAI({ baseURL, apiKey: 'sk-wrong-key-000000000000', maxRetries: 0 }).models.list(),
  (e) => e instanceof OpenAI.AuthenticationError);
console.log('openai SDK: ok');
