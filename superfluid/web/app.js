// superfluid's chat page: plain JavaScript over the public API, no framework, no build.
//
// Invariants:
// - Model output is text. It reaches the DOM through textContent only, never innerHTML;
//   a fenced code block becomes <pre><code> built from DOM nodes.
// - A conversation is {id, title, messages: [{role, content, state?, stats?, error?}]};
//   localStorage holds them all and the open one's id, written after every change.
// - At most one answer streams at a time (`streaming`). Stopping it aborts the fetch, which
//   closes the connection: that is what frees the server's lane, nothing else is sent.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = {
  conversations: "superfluid.conversations",
  current: "superfluid.current",
  settings: "superfluid.settings",
  key: "superfluid.apiKey",
};
const SETTINGS = ["system", "temperature", "top-p", "max-tokens", "seed", "extra"];
const UNTITLED = "New chat";

let conversations = [];
let current = null;   // the open conversation
let model = null;     // the served model's id, from /v1/models
let streaming = null; // {controller, conv} while an answer streams

// ------------------------------------------------------------------ storage

function load(key, fallback) {
  try {
    const v = localStorage.getItem(key);
    return v === null ? fallback : JSON.parse(v);
  } catch {
    return fallback; // storage off, or a value this page did not write
  }
}

function store(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    console.warn("superfluid: localStorage refused the write:", e); // full or off: the page still works
  }
}

function persist() {
  store(STORE.conversations, conversations);
  store(STORE.current, current ? current.id : null);
}

// ------------------------------------------------------------------ the API

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function askForKey() {
  $("auth").hidden = false;
  $("auth-key").focus();
}

async function apiError(r) {
  if (r.status === 401) askForKey();
  let message = r.statusText;
  try {
    message = (await r.json()).error.message;
  } catch { /* not OpenAI's error body: keep the status text */ }
  return new Error(`${r.status}: ${message}`);
}

async function loadModel() {
  model = null;
  $("model").textContent = "…";
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    if (!r.ok) throw await apiError(r);
    const data = (await r.json()).data || [];
    model = data.length ? data[0].id : null;
    $("model").textContent = model || "no model";
  } catch (e) {
    $("model").textContent = e.message.startsWith("401") ? "needs an API key" : "unavailable";
  }
}

// The data of each server-sent event, as a string ("[DONE]" included).
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read(); // rejects with AbortError on stop
    if (done) return;
    buf += decoder.decode(value, {stream: true}).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

function number(id, parse) {
  const v = parse($(id).value);
  return Number.isFinite(v) ? v : undefined; // empty: the server's default
}

function extraFields() {
  const text = $("extra").value.trim();
  if (!text) return {};
  const v = JSON.parse(text);
  if (v === null || typeof v !== "object" || Array.isArray(v)) throw new Error("extra fields must be a JSON object");
  return v;
}

function requestBody(conv, extra) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  for (const m of conv.messages) {
    if (m.content && m.state !== "error") messages.push({role: m.role, content: m.content});
  }
  const body = {
    model,
    temperature: number("temperature", parseFloat),
    top_p: number("top-p", parseFloat),
    max_tokens: number("max-tokens", (s) => parseInt(s, 10)),
    seed: number("seed", (s) => parseInt(s, 10)),
    ...extra,
  };
  // the page reads a stream with usage at its end: these are not the extra fields' to change
  return {...body, messages, stream: true, stream_options: {include_usage: true}};
}

// ------------------------------------------------------------------ one answer

// The answer's figures: tokens, time to first token, decode speed, prefix-cache hits.
// A stopped answer has no usage event: its tokens are the content chunks counted (each at least one).
function answerStats(t, usage, chunks) {
  const tokens = usage ? usage.completion_tokens : chunks;
  const s = {tokens, estimated: !usage, ttft_ms: t.first === null ? null : Math.round(t.first - t.start)};
  // tokens after the first over the time after it: the decode rate, apart from prefill
  s.tps = t.first !== null && tokens > 1 && t.end > t.first ? (tokens - 1) / ((t.end - t.first) / 1000) : null;
  if (usage) {
    s.prompt = usage.prompt_tokens;
    s.cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
  }
  return s;
}

async function streamAnswer(conv, answer, view, extra) {
  const controller = new AbortController();
  streaming = {controller, conv};
  setBusy(true);
  const t = {start: performance.now(), first: null, end: null};
  let usage = null;
  let chunks = 0;
  try {
    if (!model) await loadModel();
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(conv, extra)), signal: controller.signal,
    });
    if (!r.ok) throw await apiError(r);
    for await (const data of sseEvents(r.body)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) { answer.error = event.error.message; continue; } // a failed choice; the stream goes on
      if (event.usage) usage = event.usage;
      const piece = event.choices && event.choices.length ? event.choices[0].delta.content : "";
      if (piece) {
        if (t.first === null) t.first = performance.now();
        answer.content += piece;
        chunks += 1;
        showAnswer(view, answer);
      }
    }
    answer.state = answer.error ? "error" : "done";
  } catch (e) {
    answer.state = e.name === "AbortError" ? "stopped" : "error";
    if (answer.state === "error") answer.error = e.message;
  } finally {
    t.end = performance.now();
    answer.stats = answerStats(t, usage, chunks);
    streaming = null;
    setBusy(false);
    persist();
    showAnswer(view, answer);
  }
}

async function send(text) {
  if (streaming || !text.trim()) return;
  let extra;
  try {
    extra = extraFields();
    $("extra-error").hidden = true;
  } catch (e) {
    $("extra-error").textContent = "Extra request fields: " + e.message;
    $("extra-error").hidden = false;
    return;
  }
  const conv = current;
  conv.messages.push({role: "user", content: text});
  if (conv.title === UNTITLED) conv.title = text.trim().slice(0, 48);
  const answer = {role: "assistant", content: "", state: "streaming"};
  conv.messages.push(answer);
  persist();
  renderConversations();
  const views = renderMessages();
  $("input").value = "";
  await streamAnswer(conv, answer, views[views.length - 1], extra);
}

function stop() {
  if (streaming) streaming.controller.abort();
}

// ------------------------------------------------------------------ rendering

// Prose: text nodes, with `inline code` (one line, between single backticks) as <code>.
function textSpan(text) {
  const span = document.createElement("span");
  text.split(/`([^`\n]+)`/).forEach((piece, i) => {
    if (i % 2 === 0) {
      span.append(document.createTextNode(piece));
    } else {
      const code = document.createElement("code");
      code.textContent = piece;
      span.append(code);
    }
  });
  return span;
}

// Text with ``` fences: the text between fences as prose, each fenced part as <pre><code>
// (a first line that is one word names the language). An unclosed fence (still
// streaming) is code up to the end.
function renderText(el, text) {
  const nodes = text.split("```").map((part, i) => {
    if (i % 2 === 0) return textSpan(i > 0 ? part.replace(/^\n/, "") : part);
    let code = part;
    const nl = part.indexOf("\n");
    const lang = nl >= 0 ? part.slice(0, nl).trim() : "";
    const pre = document.createElement("pre");
    const codeEl = document.createElement("code");
    if (nl >= 0 && /^[\w+#.-]*$/.test(lang)) {
      code = part.slice(nl + 1);
      if (lang) codeEl.dataset.lang = lang;
    }
    codeEl.textContent = code.replace(/\n$/, "");
    pre.append(codeEl);
    return pre;
  });
  el.replaceChildren(...nodes);
}

function statsText(s, state) {
  const parts = [`${s.estimated ? "~" : ""}${s.tokens} tokens`];
  if (s.ttft_ms !== null) parts.push(`${s.ttft_ms} ms to first token`);
  if (s.tps !== null) parts.push(`${s.tps.toFixed(1)} tokens/s`);
  if (s.prompt !== undefined) parts.push(`${s.cached} of ${s.prompt} prompt tokens from the prefix cache`);
  if (state === "stopped") parts.push("stopped");
  return parts.join(" · ");
}

function showAnswer(view, m) {
  view.root.dataset.state = m.state || "done";
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  renderText(view.content, m.content);
  view.error.textContent = m.error || "";
  view.error.hidden = !m.error;
  if (m.stats) {
    const s = m.stats;
    view.stats.textContent = statsText(s, m.state);
    Object.assign(view.stats.dataset, {tokens: s.tokens, ttftMs: s.ttft_ms ?? "", tps: s.tps ?? "",
                                        prompt: s.prompt ?? "", cached: s.cached ?? ""});
  } else {
    view.stats.textContent = m.state === "streaming" ? "generating…" : "";
  }
  if (atBottom) box.scrollTop = box.scrollHeight; // follow the answer unless the reader scrolled up
}

function messageView(m) {
  const root = document.createElement("div");
  root.className = "msg " + m.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  const error = document.createElement("div");
  error.className = "error";
  const stats = document.createElement("div");
  stats.className = "stats";
  root.append(role, content, error, stats);
  const view = {root, content, error, stats};
  if (m.role === "assistant") {
    showAnswer(view, m);
  } else {
    renderText(content, m.content);
    error.hidden = true;
  }
  return view;
}

function renderMessages() {
  const views = current.messages.map(messageView);
  $("messages").replaceChildren(...views.map((v) => v.root));
  $("messages").scrollTop = $("messages").scrollHeight;
  return views;
}

function renderConversations() {
  const items = conversations.map((c) => {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (c === current) li.className = "active";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    open.addEventListener("click", () => select(c));
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.title = "Delete this conversation";
    del.textContent = "×";
    del.addEventListener("click", () => remove(c));
    li.append(open, del);
    return li;
  });
  $("conversations").replaceChildren(...items);
}

function renderAll() {
  renderConversations();
  renderMessages();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// ------------------------------------------------------------------ conversations

function newConversation() {
  stop();
  if (!(current && current.messages.length === 0)) { // an empty chat is reused, not stacked
    current = {id: Date.now().toString(36) + Math.random().toString(36).slice(2, 8), title: UNTITLED, messages: []};
    conversations.unshift(current);
  }
  persist();
  renderAll();
  $("input").focus();
}

function select(c) {
  if (c === current) return;
  stop(); // the answer stops where it is and is kept; one stream at a time
  current = c;
  persist();
  renderAll();
}

function remove(c) {
  if (streaming && streaming.conv === c) stop();
  conversations = conversations.filter((x) => x !== c);
  if (c === current) current = null;
  if (!current && conversations.length) current = conversations[0];
  if (!current) newConversation(); else { persist(); renderAll(); }
}

// ------------------------------------------------------------------ start

function restore() {
  conversations = load(STORE.conversations, []);
  if (!Array.isArray(conversations)) conversations = [];
  for (const c of conversations) {
    for (const m of c.messages) if (m.state === "streaming") m.state = "stopped"; // the page closed mid-answer
  }
  const id = load(STORE.current, null);
  current = conversations.find((c) => c.id === id) || conversations[0] || null;
  const settings = load(STORE.settings, {});
  for (const name of SETTINGS) if (typeof settings[name] === "string") $(name).value = settings[name];
  $("api-key").value = load(STORE.key, "");
}

function wire() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send($("input").value); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send($("input").value); }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newConversation);
  for (const name of SETTINGS) {
    $(name).addEventListener("input", () => {
      store(STORE.settings, Object.fromEntries(SETTINGS.map((n) => [n, $(n).value])));
    });
  }
  $("api-key").addEventListener("change", () => { store(STORE.key, $("api-key").value.trim()); loadModel(); });
  $("auth-save").addEventListener("click", () => {
    $("api-key").value = $("auth-key").value.trim();
    store(STORE.key, $("api-key").value);
    $("auth").hidden = true;
    loadModel();
  });
  $("auth-key").addEventListener("keydown", (e) => { if (e.key === "Enter") $("auth-save").click(); });
}

restore();
wire();
if (current) { persist(); renderAll(); } else newConversation();
loadModel();
