// Writes an sdmserve model directory (config.json + model.safetensors, fp32, full attention only:
// e.g. `sdm-model init --preset debug --dtype fp32`) as a GGUF file of llama.cpp's "llama"
// architecture with the same weights, so both engines run the same model.
//
//   node write-gguf.mjs MODEL_DIR OUT.gguf
//
// The mapping: sdmserve's RoPE rotates adjacent pairs (kernels/cpu/rope.cc), llama.cpp's "llama"
// rope type does too, so q and k weights are copied unpermuted; matrices are [out, in] row-major in
// both (GGUF lists dims innermost first). The vocabulary is a placeholder of vocab_size tokens
// (<unk>, <s>, </s>, then bytes): the benchmark feeds token ids, never text.
import fs from "node:fs";

const [dir, outPath] = process.argv.slice(2);
if (!dir || !outPath) {
  console.error("usage: node write-gguf.mjs MODEL_DIR OUT.gguf");
  process.exit(2);
}
const config = JSON.parse(fs.readFileSync(`${dir}/config.json`, "utf8"));
const fd = fs.openSync(`${dir}/model.safetensors`, "r");
const lenBuf = Buffer.alloc(8);
fs.readSync(fd, lenBuf, 0, 8, 0);
const headerLen = Number(lenBuf.readBigUInt64LE(0));
const headerBuf = Buffer.alloc(headerLen);
fs.readSync(fd, headerBuf, 0, headerLen, 8);
const header = JSON.parse(headerBuf.toString("utf8"));
const dataStart = 8 + headerLen;

const L = config.n_layers;
const fail = (m) => { console.error(`write-gguf: ${m}`); process.exit(1); };
const attnAt = config.attn_at ?? [];
if (attnAt.length !== L || (config.sdm_at ?? []).length || (config.swa_at ?? []).length) {
  fail("only full-attention models map onto llama.cpp's llama architecture");
}
if (config.attn_gate) fail("attention output gates have no llama.cpp equivalent");
const heads = config.n_heads;
const kvHeads = config.n_kv_heads ?? heads;
const headDim = config.head_dim ?? config.dim / heads;
if (headDim * heads !== config.dim) fail("head_dim * n_heads must equal dim");

// sdmserve name -> GGUF name.
const names = [["tok_embeddings.weight", "token_embd.weight"], ["norm.weight", "output_norm.weight"]];
if (header["output.weight"]) names.push(["output.weight", "output.weight"]);
for (let i = 0; i < L; ++i) {
  const p = `layers.${i}.`, q = `blk.${i}.`;
  names.push([`${p}attention_norm.weight`, `${q}attn_norm.weight`],
             [`${p}attention.wq.weight`, `${q}attn_q.weight`],
             [`${p}attention.wk.weight`, `${q}attn_k.weight`],
             [`${p}attention.wv.weight`, `${q}attn_v.weight`],
             [`${p}attention.wo.weight`, `${q}attn_output.weight`],
             [`${p}ffn_norm.weight`, `${q}ffn_norm.weight`],
             [`${p}feed_forward.w1.weight`, `${q}ffn_gate.weight`],
             [`${p}feed_forward.w3.weight`, `${q}ffn_up.weight`],
             [`${p}feed_forward.w2.weight`, `${q}ffn_down.weight`]);
}
const known = new Set(names.map(([s]) => s));
for (const k of Object.keys(header)) {
  if (k !== "__metadata__" && !known.has(k)) fail(`tensor ${k} has no llama.cpp equivalent`);
}
for (const [s] of names) {
  if (!header[s]) fail(`missing tensor ${s}`);
  if (header[s].dtype !== "F32") fail(`${s} is ${header[s].dtype}: write the model with --dtype fp32`);
}
const ffn = header["layers.0.feed_forward.w1.weight"].shape[0];

// ---- GGUF v3 writer ----
const chunks = [];
const u32 = (v) => { const b = Buffer.alloc(4); b.writeUInt32LE(v); chunks.push(b); };
const u64 = (v) => { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); chunks.push(b); };
const f32 = (v) => { const b = Buffer.alloc(4); b.writeFloatLE(v); chunks.push(b); };
const str = (s) => { const b = Buffer.from(s, "utf8"); u64(b.length); chunks.push(b); };
const T = { U32: 4, I32: 5, F32: 6, STR: 8, ARR: 9 };
const kvs = [
  ["general.architecture", T.STR, "llama"],
  ["general.name", T.STR, `sdmserve ${dir}`],
  ["general.alignment", T.U32, 32],
  ["llama.context_length", T.U32, 131072],
  ["llama.embedding_length", T.U32, config.dim],
  ["llama.block_count", T.U32, L],
  ["llama.feed_forward_length", T.U32, ffn],
  ["llama.attention.head_count", T.U32, heads],
  ["llama.attention.head_count_kv", T.U32, kvHeads],
  ["llama.rope.dimension_count", T.U32, headDim],
  ["llama.rope.freq_base", T.F32, config.rope_theta],
  ["llama.attention.layer_norm_rms_epsilon", T.F32, config.norm_eps],
  ["tokenizer.ggml.model", T.STR, "llama"],
];
const vocab = config.vocab_size;
const tokens = ["<unk>", "<s>", "</s>"];
for (let b = 0; tokens.length < vocab; ++b) tokens.push(`<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`);
u32(0x46554747); u32(3); u64(names.length); u64(kvs.length + 5);
for (const [k, t, v] of kvs) {
  str(k); u32(t);
  if (t === T.STR) str(v); else if (t === T.F32) f32(v); else u32(v);
}
str("tokenizer.ggml.tokens"); u32(T.ARR); u32(T.STR); u64(vocab); tokens.forEach(str);
str("tokenizer.ggml.scores"); u32(T.ARR); u32(T.F32); u64(vocab); tokens.forEach(() => f32(0));
str("tokenizer.ggml.token_type"); u32(T.ARR); u32(T.I32); u64(vocab);
tokens.forEach((_, i) => { const b = Buffer.alloc(4); b.writeInt32LE(i === 0 ? 2 : i < 3 ? 3 : 6); chunks.push(b); });
str("tokenizer.ggml.bos_token_id"); u32(T.U32); u32(1);
str("tokenizer.ggml.eos_token_id"); u32(T.U32); u32(2);
let offset = 0;
const align = (n) => Math.ceil(n / 32) * 32;
for (const [s, g] of names) {
  const shape = header[s].shape;
  str(g); u32(shape.length);
  for (const d of [...shape].reverse()) u64(d);
  u32(0);  // GGML_TYPE_F32
  u64(offset);
  offset = align(offset + (header[s].data_offsets[1] - header[s].data_offsets[0]));
}
let head = Buffer.concat(chunks);
head = Buffer.concat([head, Buffer.alloc(align(head.length) - head.length)]);
const out = fs.openSync(outPath, "w");
fs.writeSync(out, head);
let written = 0;
const buf = Buffer.alloc(64 << 20);
for (const [s] of names) {
  const [a, b] = header[s].data_offsets;
  for (let p = a; p < b; p += buf.length) {
    const n = Math.min(buf.length, b - p);
    fs.readSync(fd, buf, 0, n, dataStart + p);
    fs.writeSync(out, buf, 0, n);
  }
  const pad = align(b - a) - (b - a);
  if (pad) fs.writeSync(out, Buffer.alloc(pad));
  written += align(b - a);
}
fs.closeSync(out);
console.log(`wrote ${outPath}: ${names.length} tensors, ${(written / 1e6).toFixed(1)} MB of F32 data`);
