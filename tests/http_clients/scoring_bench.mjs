// Prompt scoring's cost against reading the same prompt plainly (not a test; docs/benchmarks.md,
// "Prompt scoring"): one prompt of random token ids (seeded), max_tokens 0, sent plainly, with
// echo and logprobs 1, and with echo and logprobs 5, alternating for `rounds` rounds so that
// drift on a shared machine falls on each alike. Prints each request's seconds and the medians.
//
//   node scoring_bench.mjs HTTP_BASE [prompt=1024] [rounds=3] [vocab=32000]
const [base, ...rest] = process.argv.slice(2);
const [promptLen, rounds, vocab] = [1024, 3, 32000].map((d, i) => (rest[i] ? Number(rest[i]) : d));

let x = 12345;
const ids = [];
for (let k = 0; k < promptLen; ++k) {
  x = (x * 1664525 + 1013904223) % 4294967296;
  ids.push(300 + (x % (vocab - 300)));
}

async function timed(body) {
  const start = performance.now();
  const res = await fetch(`${base}/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt: ids, max_tokens: 0, temperature: 0, ...body }),
  });
  const json = await res.json();
  if (res.status !== 200) throw new Error(JSON.stringify(json));
  return (performance.now() - start) / 1000;
}

const kinds = { plain: {}, 'echo, logprobs 1': { echo: true, logprobs: 1 },
                'echo, logprobs 5': { echo: true, logprobs: 5 } };
await timed({ prompt: ids.slice(0, 16) });  // warm-up
const seconds = Object.fromEntries(Object.keys(kinds).map((k) => [k, []]));
for (let r = 0; r < rounds; ++r) {
  for (const [name, body] of Object.entries(kinds)) seconds[name].push(await timed(body));
}
const median = (v) => [...v].sort((a, b) => a - b)[Math.floor(v.length / 2)];
const plain = median(seconds.plain);
for (const [name, v] of Object.entries(seconds)) {
  console.log(`${name.padEnd(18)} ${v.map((s) => s.toFixed(2)).join(' ')} s; median ` +
              `${median(v).toFixed(2)} s (${(median(v) / plain).toFixed(2)}x plain)`);
}
