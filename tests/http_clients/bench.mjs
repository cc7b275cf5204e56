// HTTP API vs gRPC throughput, one client process for both (not a test; docs/benchmarks.md,
// "HTTP vs gRPC"): `concurrency` workers keep streaming requests in flight, each a fixed prompt
// of random token ids (seeded) and greedy decoding of max_tokens tokens, so both transports run
// the same work. Phases alternate (gRPC, HTTP, gRPC, HTTP, ...) to cancel drift on a shared
// machine; each reports output tokens/s over its wall time.
//
//   node bench.mjs GRPC_ADDR HTTP_BASE [concurrency=8] [requests=64] [prompt=32] [max_tokens=64]
//                  [rounds=2]
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const [grpcAddr, httpBase, ...rest] = process.argv.slice(2);
const [concurrency, requests, promptLen, maxTokens, rounds] =
    [8, 64, 32, 64, 2].map((d, i) => (rest[i] ? Number(rest[i]) : d));
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../proto');
const def = protoLoader.loadSync(path.join(root, 'sdm/v1/sdm.proto'),
                                 { includeDirs: [root], keepCase: true, longs: Number, defaults: true });
const sdm = grpc.loadPackageDefinition(def).sdm.v1;
const stub = new sdm.SdmService(grpcAddr, grpc.credentials.createInsecure());

// Prompt i: promptLen ids in [3, 250) from a small LCG seeded by i.
function prompt(i) {
  let x = (i + 1) * 2654435761 % 4294967296;
  const ids = [];
  for (let k = 0; k < promptLen; ++k) {
    x = (x * 1664525 + 1013904223) % 4294967296;
    ids.push(3 + (x % 247));
  }
  return ids;
}

function viaGrpc(i) {
  return new Promise((resolve, reject) => {
    let tokens = 0;
    const call = stub.Generate({ token_ids: { ids: prompt(i) },
                                 sampling: { max_tokens: maxTokens, temperature: 0 } });
    call.on('data', (c) => { tokens += c.token_ids.length; });
    call.on('error', reject);
    call.on('end', () => resolve(tokens));
  });
}

async function viaHttp(i) {
  const r = await fetch(`${httpBase}/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt: prompt(i), max_tokens: maxTokens, temperature: 0, stream: true,
                           stream_options: { include_usage: true } }),
  });
  if (!r.ok) throw new Error(`HTTP ${r.status}: ${await r.text()}`);
  const decoder = new TextDecoder();
  let buffer = '';
  let tokens = 0;
  for await (const piece of r.body) {
    buffer += decoder.decode(piece, { stream: true });
    let at;
    while ((at = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, at);
      buffer = buffer.slice(at + 2);
      if (!event.startsWith('data: {')) continue;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
    }
  }
  return tokens;
}

async function phase(run) {
  let next = 0;
  let tokens = 0;
  const start = performance.now();
  await Promise.all(Array.from({ length: concurrency }, async () => {
    while (next < requests) {
      const n = await run(next++);  // (not `tokens += await`, which adds to a stale value)
      tokens += n;
    }
  }));
  const seconds = (performance.now() - start) / 1000;
  return { tokens, seconds, rate: tokens / seconds };
}

await phase(viaGrpc);  // warm-up: pages, caches, connections
await phase(viaHttp);
const totals = { grpc: [0, 0], http: [0, 0] };
for (let r = 0; r < rounds; ++r) {
  for (const [name, run] of [['grpc', viaGrpc], ['http', viaHttp]]) {
    const p = await phase(run);
    totals[name][0] += p.tokens;
    totals[name][1] += p.seconds;
    console.log(`round ${r + 1} ${name}: ${p.tokens} tokens in ${p.seconds.toFixed(2)} s = ` +
                `${p.rate.toFixed(1)} tok/s`);
  }
}
const g = totals.grpc[0] / totals.grpc[1];
const h = totals.http[0] / totals.http[1];
console.log(`concurrency ${concurrency}, ${requests} requests x ${rounds} rounds per transport, ` +
            `prompt ${promptLen}, max_tokens ${maxTokens}: gRPC ${g.toFixed(1)} tok/s, ` +
            `HTTP ${h.toFixed(1)} tok/s, HTTP/gRPC ${(h / g).toFixed(3)}`);
stub.close();
