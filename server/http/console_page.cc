#include "server/http/console_page.h"

namespace sdm {
namespace {

// clang-format off
constexpr char kPage[] = R"sdmconsole(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sdmserve console</title>
<style>
  :root { --bg: #f6f7f9; --panel: #fff; --line: #d9dde3; --text: #1d2330; --muted: #6a7385;
          --accent: #2456c7; --user: #e8eefc; --bot: #f1f3f5; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.45 system-ui, sans-serif; color: var(--text); background: var(--bg);
         display: grid; grid-template-columns: 260px 1fr 250px; height: 100vh; }
  aside, main { padding: 12px; overflow: auto; }
  aside { background: var(--panel); border-right: 1px solid var(--line); }
  aside.right { border-right: 0; border-left: 1px solid var(--line); }
  h1 { font-size: 16px; margin: 0 0 10px; } h2 { font-size: 13px; margin: 14px 0 6px; color: var(--muted);
       text-transform: uppercase; letter-spacing: .04em; }
  label { display: block; font-size: 12px; color: var(--muted); margin-top: 6px; }
  input, textarea, button { font: inherit; }
  input[type=text], input[type=number], input[type=password], textarea { width: 100%; padding: 5px 7px;
       border: 1px solid var(--line); border-radius: 5px; background: #fff; }
  button { padding: 5px 10px; border: 1px solid var(--line); border-radius: 5px; background: #fff; cursor: pointer; }
  button.primary { background: var(--accent); color: #fff; border-color: var(--accent); }
  button:disabled { opacity: .5; cursor: default; }
  #sessions { list-style: none; padding: 0; margin: 0; }
  #sessions li { display: flex; gap: 4px; align-items: center; padding: 4px; border-radius: 5px; }
  #sessions li.active { background: var(--user); }
  #sessions li span { flex: 1; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; cursor: pointer; }
  #sessions li button { padding: 1px 6px; font-size: 12px; }
  main { display: flex; flex-direction: column; }
  #log { flex: 1; overflow: auto; display: flex; flex-direction: column; gap: 8px; padding-bottom: 8px; }
  .msg { padding: 8px 10px; border-radius: 8px; white-space: pre-wrap; word-break: break-word; max-width: 85%; }
  .msg.user { background: var(--user); align-self: flex-end; }
  .msg.assistant { background: var(--bot); align-self: flex-start; }
  .msg.error { background: #fde8e8; color: #8a1c1c; }
  .meta { font-size: 11px; color: var(--muted); }
  form#send { display: flex; gap: 6px; } form#send textarea { height: 60px; resize: vertical; }
  .fig { display: flex; justify-content: space-between; padding: 3px 0; border-bottom: 1px dashed var(--line); }
  .fig b { font-variant-numeric: tabular-nums; }
</style>
</head>
<body>
<aside>
  <h1>sdmserve console</h1>
  <label for="apikey">API key (if the server has a key file)</label>
  <input id="apikey" type="password" placeholder="sk-...">
  <h2>Sessions</h2>
  <div style="display:flex; gap:4px"><input id="newid" type="text" placeholder="id (optional)">
    <button id="create">New</button></div>
  <ul id="sessions"></ul>
  <button id="oneshot" style="margin-top:6px">No session (one-shot)</button>
  <p class="meta">With a session, each turn sends only the new message: the session's state carries
    the conversation.</p>
</aside>
<main>
  <div class="meta" id="where">one-shot chat</div>
  <div id="log"></div>
  <form id="send">
    <textarea id="prompt" placeholder="Message (Enter to send, Shift+Enter for a new line)"></textarea>
    <button class="primary" id="go" type="submit">Send</button>
  </form>
</main>
<aside class="right">
  <h2>Sampling</h2>
  <label for="max_tokens">max_tokens</label><input id="max_tokens" type="number" value="64" min="1">
  <label for="temperature">temperature</label><input id="temperature" type="number" value="0.7" min="0" step="0.1">
  <label for="top_p">top_p</label><input id="top_p" type="number" value="1" min="0" max="1" step="0.05">
  <label for="seed">seed</label><input id="seed" type="number" placeholder="random" min="0">
  <h2>Live</h2>
  <div class="fig"><span>model</span><b id="f-model">-</b></div>
  <div class="fig"><span>time to first token</span><b id="f-ttft">-</b></div>
  <div class="fig"><span>tokens/s</span><b id="f-tps">-</b></div>
  <div class="fig"><span>tokens (last reply)</span><b id="f-tokens">-</b></div>
  <div class="fig"><span>session position</span><b id="f-pos">-</b></div>
  <div class="fig"><span>session state bytes</span><b id="f-bytes">-</b></div>
  <div class="fig"><span>session tier</span><b id="f-tier">-</b></div>
</aside>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let current = null;  // the selected session id, or null
let model = null;
$("apikey").value = localStorage.getItem("sdm.apikey") || "";
$("apikey").addEventListener("change", () => { localStorage.setItem("sdm.apikey", $("apikey").value); refresh(); });

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("apikey").value) h["Authorization"] = "Bearer " + $("apikey").value;
  return h;
}
async function api(method, path, body) {
  const r = await fetch("/v1" + path, { method, headers: headers(),
                                        body: body === undefined ? undefined : JSON.stringify(body) });
  const j = await r.json();
  if (!r.ok) throw new Error(j.error ? j.error.message : "HTTP " + r.status);
  return j;
}
function add(role, text) {
  const d = document.createElement("div");
  d.className = "msg " + role;
  d.textContent = text;
  $("log").appendChild(d);
  $("log").scrollTop = $("log").scrollHeight;
  return d;
}
function fmtBytes(n) {
  if (n == null) return "-";
  const u = ["B", "KiB", "MiB", "GiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; ++i; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}
function showSession(s) {
  $("f-pos").textContent = s ? s.position : "-";
  $("f-bytes").textContent = s ? fmtBytes(s.state_bytes) : "-";
  $("f-tier").textContent = s ? s.tier : "-";
}
function select(id) {
  current = id;
  $("where").textContent = id ? "session " + id : "one-shot chat";
  $("log").innerHTML = "";
  refresh();
}
// Refreshes overlap (a click can start one while another waits on the network): only the latest
// one started draws, so an answer that comes late never overwrites a newer one.
let refreshes = 0;
async function refresh() {
  const mine = ++refreshes;
  try {
    if (!model) { model = (await api("GET", "/models")).data[0].id; $("f-model").textContent = model; }
    const list = await api("GET", "/sessions?limit=1000");
    const shown = current ? await api("GET", "/sessions/" + encodeURIComponent(current)) : null;
    if (mine !== refreshes) return;
    const ul = $("sessions"); ul.innerHTML = "";
    for (const s of list.data) {
      const li = document.createElement("li");
      if (s.id === current) li.className = "active";
      li.dataset.id = s.id;
      const name = document.createElement("span");
      name.textContent = s.id + "  (" + s.position + ")";
      name.title = "resume " + s.id;
      name.onclick = () => select(s.id);
      const fork = document.createElement("button");
      fork.textContent = "fork"; fork.className = "fork";
      fork.onclick = () => api("POST", "/sessions/" + encodeURIComponent(s.id) + "/fork", {})
                               .then((f) => select(f.id), (e) => add("error", String(e.message || e)));
      const del = document.createElement("button");
      del.textContent = "×"; del.title = "delete";
      del.onclick = () => api("DELETE", "/sessions/" + encodeURIComponent(s.id))
                              .then(() => { if (current === s.id) current = null; select(current); },
                                    (e) => add("error", String(e.message || e)));
      li.append(name, fork, del);
      ul.appendChild(li);
    }
    showSession(shown);
  } catch (e) { if (mine === refreshes) add("error", String(e.message || e)); }
}
$("create").onclick = async () => {
  try {
    const body = $("newid").value ? { session_id: $("newid").value } : {};
    const s = await api("POST", "/sessions", body);
    $("newid").value = "";
    select(s.id);
  } catch (e) { add("error", String(e.message || e)); }
};
$("oneshot").onclick = () => select(null);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("send").requestSubmit(); }
});

$("send").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("prompt").value;
  if (!text.trim()) return;
  $("prompt").value = "";
  add("user", text);
  const out = add("assistant", "");
  $("go").disabled = true;
  const body = { model, messages: [{ role: "user", content: text }], stream: true,
                 stream_options: { include_usage: true },
                 max_tokens: Number($("max_tokens").value), temperature: Number($("temperature").value),
                 top_p: Number($("top_p").value) };
  if ($("seed").value !== "") body.seed = Number($("seed").value);  // else a fresh one
  if (current) body.session_id = current;
  const start = performance.now();
  let first = 0;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!r.ok) { const j = await r.json(); throw new Error(j.error ? j.error.message : "HTTP " + r.status); }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let at;
      while ((at = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, at); buffer = buffer.slice(at + 2);
        if (!event.startsWith("data: ")) continue;  // a keep-alive comment
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.choices.length && chunk.choices[0].delta.content) {
          if (!first) { first = performance.now(); $("f-ttft").textContent = (first - start).toFixed(0) + " ms"; }
          out.textContent += chunk.choices[0].delta.content;
          $("log").scrollTop = $("log").scrollHeight;
        }
        if (chunk.usage) {
          const n = chunk.usage.completion_tokens;
          const secs = (performance.now() - (first || start)) / 1000;
          $("f-tokens").textContent = n;
          $("f-tps").textContent = n > 1 && secs > 0 ? ((n - 1) / secs).toFixed(1) : "-";
        }
      }
    }
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = $("f-tokens").textContent + " tokens, " + $("f-tps").textContent + " tok/s";
    out.appendChild(meta);
  } catch (err) {
    add("error", String(err.message || err));
  } finally {
    $("go").disabled = false;
    refresh();
  }
});
refresh();
</script>
</body>
</html>
)sdmconsole";
// clang-format on

}  // namespace

absl::string_view ConsolePageHtml() { return absl::string_view(kPage, sizeof(kPage) - 1); }

}  // namespace sdm
