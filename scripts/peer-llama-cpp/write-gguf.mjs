// Writes an sdmserve model directory (config.json + model.safetensors, fp32, full attention only:
// e.g. `sdm-model init --preset debug --dtype fp32`) as a GGUF file of llama.cpp's "llama"
// architecture with the same weights, so both engines run the same model.
//
//   node write-gguf.mjs MODEL_DIR OUT.gguf [--weights f32|f16|bf16]
//
// --weights f16 or bf16 stores the matrices (2-D tensors) as 16-bit values, rounded to nearest
// even, for llama.cpp's 16-bit runs (against sdmserve's --cpu_dtype bf16); norms stay F32.
//
// The mapping: sdmserve's RoPE rotates adjacent pairs (kernels/cpu/rope.cc), llama.cpp's "llama"
// rope type does too, so q and k weights are copied unpermuted; matrices are [out, in] row-major in
// both (GGUF lists dims innermost first). The vocabulary is a placeholder of vocab_size tokens
// (<unk>, <s>, </s>, then bytes): the benchmark feeds token ids, never text.
import fs from "node:fs";

const [dir, outPath, ...rest] = process.argv.slice(2);
let weights = "f32";
if (rest.length === 2 && rest[0] === "--weights") weights = rest[1];
if (!dir || !outPath || !["f32", "f16", "bf16"].includes(weights) ||
    (rest.length !== 0 && rest.length !== 2)) {
  console.error("usage: node write-gguf.mjs MODEL_DIR OUT.gguf [--weights f32|f16|bf16]");
  process.exit(2);
}
// GGML type ids and bytes per value.
const GGML = { f32: [0, 4], f16: [1, 2], bf16: [30, 2] };
const f32Bits = new Uint32Array(1);
const f32View = new Float32Array(f32Bits.buffer);
// fp32 bits -> bf16 bits, round to nearest even (NaN kept quiet).
const toBf16 = (bits) => {
  if ((bits & 0x7fffffff) > 0x7f800000) return ((bits >>> 16) | 0x40) & 0xffff;
  return ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) & 0xffff;
};
// fp32 value -> IEEE half bits, round to nearest even (overflow to inf, subnormals kept).
const toF16 = (x) => {
  f32View[0] = x;
  const b = f32Bits[0];
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  let mant = b & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let h = mant >>> shift;
    const rem = mant & ((1 << shift) - 1), half = 1 << (shift - 1);
    if (rem > half || (rem === half && (h & 1))) h += 1;
    return sign | h;
  }
  let h = (e << 10) | (mant >>> 13);
  const rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem === 0x1000 && (h & 1))) h += 1;  // may carry into the exponent: right
  return sign | h;
};
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
  const type = shape.length === 2 ? weights : "f32";
  u32(GGML[type][0]);
  u64(offset);
  offset = align(offset + (header[s].data_offsets[1] - header[s].data_offsets[0]) / 4 * GGML[type][1]);
}
let head = Buffer.concat(chunks);
head = Buffer.concat([head, Buffer.alloc(align(head.length) - head.length)]);
const out = fs.openSync(outPath, "w");
fs.writeSync(out, head);
let written = 0;
const buf = Buffer.alloc(64 << 20);
for (const [s] of names) {
  const [a, b] = header[s].data_offsets;
  const half = header[s].shape.length === 2 && weights !== "f32";
  for (let p = a; p < b; p += buf.length) {
    const n = Math.min(buf.length, b - p);
    fs.readSync(fd, buf, 0, n, dataStart + p);
    if (!half) {
      fs.writeSync(out, buf, 0, n);
      continue;
    }
    const o = Buffer.alloc(n / 2);
    for (let i = 0; i < n / 4; ++i) {
      o.writeUInt16LE(weights === "bf16" ? toBf16(buf.readUInt32LE(4 * i))
                                         : toF16(buf.readFloatLE(4 * i)), 2 * i);
    }
    fs.writeSync(out, o);
  }
  const bytes = half ? (b - a) / 2 : b - a;
  const pad = align(bytes) - bytes;
  if (pad) fs.writeSync(out, Buffer.alloc(pad));
  written += align(bytes);
}
fs.closeSync(out);
console.log(`wrote ${outPath}: ${names.length} tensors, ${(written / 1e6).toFixed(1)} MB of data (matrices ${weights.toUpperCase()})`);
