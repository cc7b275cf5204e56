// llama.cpp's decode throughput (through npm's node-llama-cpp prebuilt CPU build) on a GGUF from
// write-gguf.mjs, with sdm-bench decode's protocol: each of B sequences is prefilled with random
// tokens to CONTEXT, then `warmup` untimed and `steps` timed steps of one token per sequence (the B
// tokens of a step evaluated as one batch). Prints one JSON line: median step ms and tokens/s.
//
//   node bench.mjs MODEL.gguf CONTEXT BATCH [--steps 10] [--warmup 2] [--threads 2]
//                  [--kv f32|f16] [--flash off|on|auto] [--seed 1] [--vocab 258]
import { getLlama } from "node-llama-cpp";

const args = process.argv.slice(2);
const opt = { steps: 10, warmup: 2, threads: 2, kv: "f32", flash: "off", seed: 1, vocab: 258 };
const pos = [];
for (let i = 0; i < args.length; ++i) {
  if (args[i].startsWith("--")) opt[args[i].slice(2)] = args[++i];
  else pos.push(args[i]);
}
const [modelPath, contextArg, batchArg] = pos;
const context = Number(contextArg), batch = Number(batchArg);
const steps = Number(opt.steps), warmup = Number(opt.warmup), threads = Number(opt.threads);
if (!modelPath || !(context > 0) || !(batch > 0)) {
  console.error("usage: node bench.mjs MODEL.gguf CONTEXT BATCH [--steps N] [--warmup N] [--threads N] [--kv f32|f16] [--flash off|on|auto]");
  process.exit(2);
}
let seed = Number(opt.seed) >>> 0 || 1;
const rand = () => { seed ^= seed << 13; seed >>>= 0; seed ^= seed >>> 17; seed ^= seed << 5; seed >>>= 0; return seed; };

const llama = await getLlama({ gpu: false, build: "never" });
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
const vocab = Number(opt.vocab);  // the model's vocab_size: random tokens in [3, vocab)
const kvType = opt.kv.toUpperCase();
const ctx = await model.createContext({
  contextSize: context + warmup + steps + 8,
  sequences: batch,
  batchSize: 512,
  threads,
  flashAttention: opt.flash === "auto" ? "auto" : opt.flash === "on",
  experimentalKvCacheKeyType: kvType,
  experimentalKvCacheValueType: kvType,
});
const seqs = [];
for (let b = 0; b < batch; ++b) seqs.push(ctx.getSequence());
const token = () => 3 + (rand() % (vocab - 3));
const t0 = performance.now();
for (const s of seqs) {
  const prompt = Array.from({ length: context }, token);
  await s.evaluateWithoutGeneratingNewTokens(prompt);
}
const prefillS = (performance.now() - t0) / 1e3;
const times = [];
for (let r = 0; r < warmup + steps; ++r) {
  const t = performance.now();
  await Promise.all(seqs.map((s) => s.evaluateWithoutGeneratingNewTokens([token()])));
  if (r >= warmup) times.push(performance.now() - t);
}
times.sort((a, b) => a - b);
const median = times[Math.floor(times.length / 2)];
console.log(JSON.stringify({
  engine: "llama.cpp (node-llama-cpp)", context, batch, threads, kv: opt.kv, flash: opt.flash,
  prefill_s: prefillS, ms_per_step_median: median, tokens_per_s: (batch * 1000) / median,
}));
await ctx.dispose();
await model.dispose();
