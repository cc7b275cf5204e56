// Logits of the same model in both engines: random token ids fed to llama.cpp (node-llama-cpp, F32
// KV cache, flash attention off) and to sdmserve (`sdm-cli logits`), the last position's logits
// compared. Prints one JSON line: the largest absolute difference, that difference relative to
// the largest |logit|, and whether the argmax agrees.
//
//   node compare-logits.mjs MODEL.gguf MODEL_DIR SDM_CLI [--tokens 64] [--seed 1] [--vocab 258]
import { execFileSync } from "node:child_process";
import { getLlama } from "node-llama-cpp";

const args = process.argv.slice(2);
const opt = { tokens: 64, seed: 1, vocab: 258, threads: 2 };
const pos = [];
for (let i = 0; i < args.length; ++i) {
  if (args[i].startsWith("--")) opt[args[i].slice(2)] = args[++i];
  else pos.push(args[i]);
}
const [ggufPath, modelDir, sdmCli] = pos;
if (!ggufPath || !modelDir || !sdmCli) {
  console.error("usage: node compare-logits.mjs MODEL.gguf MODEL_DIR SDM_CLI [--tokens N] [--seed S]");
  process.exit(2);
}
const n = Number(opt.tokens), vocab = Number(opt.vocab);
let seed = Number(opt.seed) >>> 0 || 1;
const rand = () => { seed ^= seed << 13; seed >>>= 0; seed ^= seed >>> 17; seed ^= seed << 5; seed >>>= 0; return seed; };
const tokens = Array.from({ length: n }, () => 3 + (rand() % (vocab - 3)));

const llama = await getLlama({ gpu: false, build: "never" });
const model = await llama.loadModel({ modelPath: ggufPath, gpuLayers: 0 });
const ctx = await model.createContext({
  contextSize: n + 8, sequences: 1, threads: Number(opt.threads), flashAttention: false,
  experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
});
const input = tokens.slice(0, -1);
input.push([tokens[n - 1], { generateNext: { logits: true } }]);
const out = await ctx.getSequence().controlledEvaluate(input);
const theirs = out[n - 1].next.logits;

const ours = JSON.parse(execFileSync(sdmCli, [
  "logits", "--model", modelDir, "--tokens", tokens.join(","), "--device", "cpu",
  "--threads", String(opt.threads)], { maxBuffer: 1 << 26 }).toString()).logits[0];

let maxDiff = 0, maxAbs = 0, argOurs = 0, argTheirs = 0;
for (let t = 0; t < ours.length; ++t) {
  const l = theirs.get(t);
  if (l === undefined) throw new Error(`llama.cpp returned no logit for token ${t}`);
  maxDiff = Math.max(maxDiff, Math.abs(ours[t] - l));
  maxAbs = Math.max(maxAbs, Math.abs(ours[t]));
  if (ours[t] > ours[argOurs]) argOurs = t;
  if (l > theirs.get(argTheirs)) argTheirs = t;
}
console.log(JSON.stringify({
  tokens: n, vocab: ours.length, max_abs_diff: maxDiff, max_abs_logit: maxAbs,
  relative: maxDiff / maxAbs, argmax_sdmserve: argOurs, argmax_llama_cpp: argTheirs,
  argmax_agrees: argOurs === argTheirs,
}));
await ctx.dispose();
await model.dispose();
