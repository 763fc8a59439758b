// The web page of `justfit serve`: a chat over /v1/chat/completions with prompt_cache_key sessions, and a
// live view of where each model's memory goes (/justfit/memory/events). Plain JS, no build step; every
// request goes to this page's own origin.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("justfit.key") || "", model: "default", session: null,
  messages: [], abort: null, pendingTool: null, memoryAbort: null };

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const kid of kids) e.append(kid);
  return e;
}

function mb(n) {
  if (n === null || n === undefined) return "–";
  if (n >= 1e9) return (n / 1e9).toFixed(2) + " GB";
  if (n >= 1e6) return (n / 1e6).toFixed(1) + " MB";
  if (n >= 1e3) return (n / 1e3).toFixed(1) + " kB";
  return n + " B";
}

function headers(json) {
  const h = {};
  if (json) h["content-type"] = "application/json";
  if (state.key) h.authorization = "Bearer " + state.key;
  return h;
}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: headers(options.body !== undefined) });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || r.status + " " + r.statusText);
  return body;
}

// Server-sent events read with fetch (EventSource cannot send the API key): onData gets each event's JSON.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

// -- the API key ---------------------------------------------------------------------------------------
async function start() {
  const cfg = await (await fetch("/ui/config.json")).json();
  if (cfg.api_key_required && !state.key) return askKey("");
  try {
    await connected();
  } catch (e) {
    askKey(e.message);
  }
}

function askKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  $("key-input").focus();
}

async function useKey(ev) {
  ev.preventDefault();
  state.key = $("key-input").value.trim();
  try {
    await connected();
    sessionStorage.setItem("justfit.key", state.key);
    $("key-form").hidden = true;
    $("key-input").value = "";
  } catch (e) {
    state.key = "";
    askKey("That key was refused: " + e.message);
  }
}

async function connected() {
  const models = await api("/v1/models");
  state.model = (models.data[0] && models.data[0].id) || "default";
  $("model-name").textContent = state.model;
  await refreshSessions();
  watchMemory();
}

// -- sessions ------------------------------------------------------------------------------------------
function newName() {
  const d = new Date().toISOString().replace(/[-:T]/g, "").slice(0, 14);
  return "web-" + d + "-" + Math.random().toString(16).slice(2, 6);
}

function saved(name) {
  try { return JSON.parse(localStorage.getItem("justfit.transcript." + name)) || null; } catch (e) { return null; }
}

function save() {
  if (state.session) localStorage.setItem("justfit.transcript." + state.session, JSON.stringify(state.messages));
}

async function refreshSessions() {
  const { sessions } = await api("/justfit/sessions");
  const list = $("session-list");
  list.replaceChildren();
  for (const s of sessions) {
    const del = el("button", { title: "Delete this session", text: "×", "data-delete": s.name });
    const li = el("li", { "data-session": s.name, class: s.name === state.session ? "current" : "" },
      el("span", {}, s.name, el("small", { text: s.tokens + " tokens" + (s.running ? " · running" : "") })), del);
    li.addEventListener("click", (ev) => {
      if (ev.target === del) deleteSession(s.name); else resume(s.name);
    });
    list.append(li);
  }
}

async function resume(name) {
  state.session = name;
  state.pendingTool = null;
  state.messages = saved(name) || [];
  if (!state.messages.length) {
    const s = await api("/justfit/sessions/" + encodeURIComponent(name));
    state.messages = s.messages.filter((m) => m.role !== "system");
    if (!state.messages.length && s.text) state.notice = "This session's history (" + s.tokens + " tokens) was made by another client: " + s.text.slice(-400);
  }
  render();
  refreshSessions();
}

async function deleteSession(name) {
  try {
    await api("/justfit/sessions/" + encodeURIComponent(name), { method: "DELETE" });
    localStorage.removeItem("justfit.transcript." + name);
    if (state.session === name) newSession();
  } catch (e) {
    $("chat-error").textContent = e.message;
  }
  refreshSessions();
}

function newSession() {
  state.session = null;
  state.messages = [];
  state.pendingTool = null;
  render();
  refreshSessions();
}

// -- the transcript ------------------------------------------------------------------------------------
function statsLine(s) {
  if (!s) return "";
  const parts = [];
  if (s.prompt !== undefined) parts.push("cached " + s.cached + " of " + s.prompt + " prompt tokens");
  if (s.ttft !== undefined) parts.push("TTFT " + s.ttft.toFixed(2) + " s");
  if (s.tps !== undefined) parts.push(s.tps.toFixed(1) + " tokens/s");
  if (s.stopped) parts.push("stopped");
  if (s.finish) parts.push(s.finish);
  return parts.join(" · ");
}

function messageNode(m) {
  const node = el("div", { class: "msg " + m.role },
    el("div", { class: "who", text: m.role === "tool" ? "tool result" : m.role }),
    el("div", { class: "text", text: m.content || "" }));
  for (const c of m.tool_calls || []) {
    node.append(el("div", { class: "tool-call", text: "call " + c.function.name + "(" + c.function.arguments + ")" }));
  }
  node.append(el("div", { class: "stats", text: statsLine(m.stats) }));
  return node;
}

function render() {
  $("session-title").textContent = state.session ? "Session " + state.session : "New session (named on the first message)";
  const t = $("transcript");
  t.replaceChildren(...state.messages.map(messageNode));
  if (state.notice) { t.prepend(el("p", { class: "muted", text: state.notice })); state.notice = ""; }
  t.scrollTop = t.scrollHeight;
  $("tool-reply").hidden = !state.pendingTool;
  $("tool-reply").textContent = state.pendingTool ? "Your next message is the result of " + state.pendingTool.function.name : "";
}

function settings() {
  const num = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const body = { temperature: num("temperature"), top_p: num("top_p"), max_tokens: num("max_tokens"), seed: num("seed") };
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);
  return body;
}

function wire(messages) {
  const out = messages.map((m) => {
    const w = { role: m.role, content: m.content };
    if (m.tool_calls) w.tool_calls = m.tool_calls;
    if (m.tool_call_id) w.tool_call_id = m.tool_call_id;
    return w;
  });
  const system = $("system").value.trim();
  return system ? [{ role: "system", content: system }, ...out] : out;
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.abort) return;
  $("chat-error").textContent = "";
  let options;
  try {
    options = settings();
  } catch (e) {
    $("chat-error").textContent = "Tools are not valid JSON: " + e.message;
    return;
  }
  if (!state.session) state.session = newName();
  const turn = state.pendingTool ? { role: "tool", tool_call_id: state.pendingTool.id, content: text } : { role: "user", content: text };
  state.pendingTool = null;
  state.messages.push(turn);
  const reply = { role: "assistant", content: "", stats: {} };
  state.messages.push(reply);
  $("prompt").value = "";
  render();
  const node = $("transcript").lastChild;
  const body = { model: state.model, messages: wire(state.messages.slice(0, -1)), stream: true,
    stream_options: { include_usage: true }, prompt_cache_key: state.session, prompt_cache_retention: "24h", ...options };
  state.abort = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const sent = performance.now();
  let first = null, pieces = 0;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body), signal: state.abort.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || r.status + " " + r.statusText);
    }
    await readEvents(r, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) {
        reply.stats.prompt = chunk.usage.prompt_tokens;
        reply.stats.cached = (chunk.usage.prompt_tokens_details || {}).cached_tokens || 0;
        reply.stats.completion = chunk.usage.completion_tokens;
      }
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if ((d.content || d.tool_calls) && first === null) first = performance.now();
        if (d.content) { reply.content += d.content; pieces++; }
        for (const tc of d.tool_calls || []) {
          reply.tool_calls = reply.tool_calls || [];
          if (tc.id) reply.tool_calls.push({ id: tc.id, type: "function", function: { name: tc.function.name, arguments: "" } });
          const call = reply.tool_calls[reply.tool_calls.length - 1];
          if (call && tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
        }
        if (choice.finish_reason) reply.stats.finish = choice.finish_reason;
      }
      node.replaceWith(messageNode(reply));
      $("transcript").lastChild.scrollIntoView({ block: "end" });
    });
  } catch (e) {
    if (e.name === "AbortError") reply.stats.stopped = true; else $("chat-error").textContent = e.message;
  } finally {
    const end = performance.now();
    if (first !== null) {
      reply.stats.ttft = (first - sent) / 1000;
      const n = reply.stats.completion || pieces;
      if (end > first && n > 1) reply.stats.tps = (n - 1) / ((end - first) / 1000);
    }
    if (reply.tool_calls && reply.tool_calls.length) state.pendingTool = reply.tool_calls[reply.tool_calls.length - 1];
    state.abort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    save();
    render();
    refreshSessions().catch(() => {});
  }
}

// -- the memory view -----------------------------------------------------------------------------------
async function watchMemory() {
  if (state.memoryAbort) return;
  state.memoryAbort = new AbortController();
  for (;;) {
    try {
      const r = await fetch("/justfit/memory/events", { headers: headers(false), signal: state.memoryAbort.signal });
      if (!r.ok) throw new Error(r.status + " " + r.statusText);
      $("live").textContent = "live";
      await readEvents(r, drawMemory);
    } catch (e) {
      if (e.name === "AbortError") return;
    }
    $("live").textContent = "reconnecting…";
    await new Promise((ok) => setTimeout(ok, 2000));
  }
}

function bar(parts, total) {
  const b = el("div", { class: "bar" });
  for (const [cls, bytes, title] of parts) {
    if (!bytes) continue;
    const s = el("span", { class: cls, title: title + ": " + mb(bytes) });
    s.style.width = Math.max(0.3, (100 * bytes) / total) + "%";
    b.append(s);
  }
  return b;
}

function legend(items) {
  return el("div", { class: "legend" }, ...items.map(([cls, label]) => el("span", {}, el("i", { class: cls }), label)));
}

// rowAttrs(i): the attributes of row i (data-* for what a reader or a test looks up).
function table(head, rows, rowAttrs = () => ({})) {
  const t = el("table", {}, el("tr", {}, ...head.map((h, i) => el("th", { class: i ? "num" : "", text: h }))));
  rows.forEach((r, n) => t.append(el("tr", rowAttrs(n), ...r.map((c, i) => el("td", { class: i ? "num" : "", text: String(c) })))));
  return t;
}

function kvBytes(s) {
  return Object.values(s.bytes).reduce((a, b) => a + (b || 0), 0);
}

function spark(points, key, cls) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 300 60");
  svg.setAttribute("preserveAspectRatio", "none");
  const vals = points.map((p) => p[key]).filter((v) => v !== null);
  const top = Math.max(1e-9, ...vals);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("class", cls);
  line.setAttribute("points", points.map((p, i) => (300 * i) / Math.max(1, points.length - 1) + "," + (58 - (56 * (p[key] || 0)) / top)).join(" "));
  svg.append(line);
  return svg;
}

function drawUnloaded(m) {
  const card = el("section", { class: "card", "data-model": m.model });
  card.append(el("h3", {}, m.model + " ", el("span", { class: "phase unloaded", "data-phase": m.phase, text: "not loaded" })));
  card.append(el("div", { class: "muted", text: "Weights and KV released; its sessions wait on disk and the next request loads it." }));
  const ck = m.checkpoints;
  if (ck) card.append(table(["session", "tokens", "pages", "on disk"], ck.sessions.map((s) => [s.name, s.tokens, s.pages, mb(s.disk_bytes)])));
  return card;
}

function drawModel(m) {
  if (!m.loaded) return drawUnloaded(m);
  const kv = m.kv, f = kv.by_format;
  const weights = m.components.filter((c) => c.kind !== "kv");
  const resident = weights.filter((c) => c.resident).reduce((a, c) => a + c.bytes, 0);
  const released = weights.filter((c) => !c.resident).reduce((a, c) => a + c.bytes, 0);
  const total = m.budget.limit_bytes || resident + released + (kv.engine_bytes || kv.pool_bytes) || 1;
  const card = el("section", { class: "card", "data-model": m.model });
  card.append(el("h3", {}, m.model + " ", el("span", { class: "phase " + m.phase, "data-phase": m.phase, text: "phase: " + m.phase })));
  card.append(el("div", { class: "muted", text: "Budget: " + (m.budget.text || "none") + " · resident " + mb(m.budget.resident_bytes) + " · KV share " + mb(kv.budget_bytes) }));
  card.append(bar([["c-weights", resident, "weights resident"], ["c-q", f.sealed_quantized, "KV sealed " + kv.format.bits + "-bit"],
    ["c-fp", f.sealed_float, "KV sealed float"], ["c-open", f.open, "KV open pages"], ["c-work", kv.workspace_bytes, "decode workspace"],
    ["c-released", released, "weights released"]], Math.max(total, resident + released + kv.pool_bytes)));
  card.append(legend([["c-weights", "weights " + mb(resident)], ["c-q", "KV " + kv.format.bits + "-bit sealed " + mb(f.sealed_quantized)],
    ["c-fp", "KV float sealed " + mb(f.sealed_float)], ["c-open", "open pages " + mb(f.open)],
    ["c-work", "workspace " + mb(kv.workspace_bytes)], ["c-released", "released " + mb(released)]]));
  const grid = el("div", { class: "grid2" });
  const left = el("div", {}, el("h2", { text: "Components" }),
    table(["component", "kind", "bytes", "resident"], m.components.map((c) => [c.name, c.kind, mb(c.bytes), c.resident ? "yes" : "released"]),
      (i) => ({ "data-component": m.components[i].name, "data-resident": m.components[i].resident ? "yes" : "no" })));
  const right = el("div", {}, el("h2", { text: "KV by session" }),
    table(["session", "tokens", kv.format.bits + "-bit sealed", "float sealed", "open page", "float window", "workspace"],
      kv.sessions.map((s) => [s.name, s.tokens, mb(s.bytes.sealed_quantized), mb(s.bytes.sealed_float), mb(s.bytes.open), mb(s.bytes.float_window), mb(s.bytes.workspace)]),
      (i) => ({ "data-session": kv.sessions[i].name, "data-kv-bytes": String(kvBytes(kv.sessions[i])) })),
    el("div", { class: "muted", text: "Pool: " + kv.pages_used + " pages used, " + kv.pages_free + " free · prefix cache " + kv.prefix_cache.pages + " pages (" + mb(kv.prefix_cache.bytes) + ")" }));
  grid.append(left, right);
  card.append(grid);
  const ck = m.checkpoints, r = m.reuse;
  const lower = el("div", { class: "grid2" });
  lower.append(el("div", {}, el("h2", { text: "Checkpoints on disk" }),
    el("div", { class: "muted", text: "Store: " + mb(ck.store_bytes) }),
    table(["session", "tokens", "pages", "on disk"], ck.sessions.map((s) => [s.name, s.tokens, s.pages, mb(s.disk_bytes)]))));
  const trend = m.trend.slice(-120);
  const last = trend.length ? trend[trend.length - 1] : {};
  lower.append(el("div", {}, el("h2", { text: "Reuse and speed (last minutes)" }),
    el("div", { text: "Prefix reuse: " + r.cached_tokens + " of " + r.prompt_tokens + " prompt tokens" + (r.cached_ratio !== null ? " (" + (100 * r.cached_ratio).toFixed(0) + "%)" : "") }),
    el("div", { text: "Turns " + r.turns + " · mean TTFT " + (r.ttft_mean_s !== null ? r.ttft_mean_s.toFixed(2) + " s" : "–") + " · now " + (last.completion_tokens_per_s || 0) + " tokens/s · queue " + m.queue.waiting + " waiting, " + m.queue.running + " running" }),
    spark(trend, "completion_tokens_per_s", "tps"), spark(trend, "ttft_s", "ttft"),
    legend([["c-q", "tokens/s"], ["c-work", "TTFT"]])));
  card.append(lower);
  return card;
}

function drawMemory(snap) {
  $("memory-models").replaceChildren(...snap.models.map(drawModel));
}

// -- wiring --------------------------------------------------------------------------------------------
function show(view) {
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.view === view);
  $("view-chat").hidden = view !== "chat";
  $("view-memory").hidden = view !== "memory";
}

document.addEventListener("DOMContentLoaded", () => {
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => show(b.dataset.view));
  $("key-form").addEventListener("submit", useKey);
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("new-session").addEventListener("click", newSession);
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  render();
  start();
});
