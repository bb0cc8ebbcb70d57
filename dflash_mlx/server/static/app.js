// The chat page of `dflash-mlx serve`: conversations kept in this browser (localStorage), replies streamed from
// the server's own /v1/chat/completions with per-token origins ("dflash": {"origins": true}).
"use strict";

const STORE = "dflash-chat.conversations";
const SETTINGS = "dflash-chat.settings";
const KEY = "dflash-chat.api-key";
const CODES = { drafter: "d", lookup: "l", target: "t" };

const $ = (id) => document.getElementById(id);
const state = {
  conversations: [],
  current: null, // id of the conversation shown
  model: null,
  controller: null, // the running request's AbortController
  streaming: null, // {conversation, message, started, firstToken}
  leaving: false, // the page is being unloaded (reload, closed tab)
};

// ---- storage -------------------------------------------------------------------------------------------------
function load() {
  try { state.conversations = JSON.parse(localStorage.getItem(STORE)) || []; } catch (e) { state.conversations = []; }
  // A reply still streaming when the page went away (reload, closed tab) keeps what had arrived, marked as such.
  let interrupted = false;
  for (const c of state.conversations) {
    for (const m of c.messages || []) {
      if (m.partial) { delete m.partial; m.stopped = true; m.interrupted = interrupted = true; }
    }
  }
  if (interrupted) save();
  state.current = state.conversations.length ? state.conversations[0].id : null;
  let s = {};
  try { s = JSON.parse(localStorage.getItem(SETTINGS)) || {}; } catch (e) { s = {}; }
  if (s.system !== undefined) $("system-prompt").value = s.system;
  if (s.temperature !== undefined) $("temperature").value = s.temperature;
  if (s.top_p !== undefined) $("top-p").value = s.top_p;
  if (s.max_tokens !== undefined) $("max-tokens").value = s.max_tokens;
  if (s.show_origins !== undefined) $("show-origins").checked = s.show_origins;
  applyOriginToggle();
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state.conversations));
  } catch (e) {
    setStatus("this browser's storage is full: delete old conversations", true);
  }
}

function saveSettings() {
  localStorage.setItem(SETTINGS, JSON.stringify({
    system: $("system-prompt").value, temperature: $("temperature").value, top_p: $("top-p").value,
    max_tokens: $("max-tokens").value, show_origins: $("show-origins").checked,
  }));
}

function apiKey() { return localStorage.getItem(KEY) || ""; }

// ---- conversations -------------------------------------------------------------------------------------------
function conversation() { return state.conversations.find((c) => c.id === state.current) || null; }

function newConversation() {
  const c = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: "New chat",
              created: Date.now(), messages: [] };
  state.conversations.unshift(c);
  state.current = c.id;
  return c;
}

function renderList() {
  const nav = $("conversations");
  nav.textContent = "";
  for (const c of state.conversations) {
    const row = document.createElement("div");
    row.className = "conv" + (c.id === state.current ? " active" : "");
    row.dataset.id = c.id;
    const title = document.createElement("button");
    title.className = "conv-title";
    title.textContent = c.title || "New chat";
    title.title = c.title || "New chat";
    title.addEventListener("click", () => { if (!state.streaming) { state.current = c.id; renderAll(); closeSide(); } });
    const del = document.createElement("button");
    del.className = "icon conv-delete";
    del.textContent = "×";
    del.title = "Delete this conversation";
    del.addEventListener("click", () => {
      if (state.streaming && state.streaming.conversation === c) return;
      if (!confirm(`Delete "${c.title}"?`)) return;
      state.conversations = state.conversations.filter((x) => x !== c);
      if (state.current === c.id) state.current = state.conversations.length ? state.conversations[0].id : null;
      save();
      renderAll();
    });
    row.append(title, del);
    nav.appendChild(row);
  }
}

function renderAll() {
  renderList();
  const box = $("messages");
  box.textContent = "";
  const c = conversation();
  if (!c || !c.messages.length) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.innerHTML = "<h1>dflash-mlx</h1><p>Speculative decoding, lossless: a drafter proposes a block of tokens, " +
      "the target verifies them in one pass. Send a message and watch where each token comes from.</p>";
    box.appendChild(empty);
  } else {
    c.messages.forEach((m, i) => box.appendChild(messageElement(c, m, i)));
  }
  updateButtons();
  box.scrollTop = box.scrollHeight;
}

// ---- one message ---------------------------------------------------------------------------------------------
function messageElement(c, m, index) {
  const el = document.createElement("article");
  el.className = `msg ${m.role}` + (state.streaming && state.streaming.message === m ? " streaming" : "");
  el.dataset.index = String(index);
  const body = document.createElement("div");
  body.className = "body";
  el.appendChild(body);
  fillBody(body, m);
  if (m.role === "assistant" && ((m.tokens && m.tokens.length) || m.stats)) el.appendChild(Render.renderStats(m));
  if (m.error) {
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = m.error;
    el.appendChild(err);
  }
  const actions = document.createElement("div");
  actions.className = "actions";
  if (el.classList.contains("streaming")) actions.hidden = true;  // shown once the reply is complete
  const button = (label, title, handler, cls) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "link " + (cls || "");
    b.textContent = label;
    b.title = title;
    b.addEventListener("click", handler);
    actions.appendChild(b);
  };
  if (m.role === "user") {
    button("Edit", "Edit this message and send it again", () => editMessage(el, c, index), "edit");
  } else {
    button("Copy", "Copy the reply's text", () => copyText(m.content || ""), "copy");
    if (index === c.messages.length - 1) {
      button("Regenerate", "Ask again for this reply", () => regenerate(c), "regenerate");
    }
  }
  el.appendChild(actions);
  return el;
}

function fillBody(body, m) {
  if (m.role === "user") {
    body.textContent = m.content;
    return;
  }
  body.innerHTML = Render.renderMarkdown(m.content || "");
  for (const a of body.querySelectorAll("a[href]")) {  // a link in a reply opens beside the conversation
    a.target = "_blank";
    a.rel = "noopener noreferrer";
  }
  Render.markOrigins(body, m.tokens);
  if (m.reasoning) {  // a thinking model's reasoning, folded above the answer
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const text = document.createElement("div");
    text.textContent = m.reasoning;
    details.append(summary, text);
    body.prepend(details);
  }
}

function copyText(text) {
  if (navigator.clipboard) navigator.clipboard.writeText(text).catch(() => {});
}

function editMessage(el, c, index) {
  if (state.streaming) return;
  const m = c.messages[index];
  const body = el.querySelector(".body");
  body.textContent = "";
  const area = document.createElement("textarea");
  area.className = "edit-area";
  area.value = m.content;
  const resend = document.createElement("button");
  resend.className = "primary";
  resend.type = "button";
  resend.textContent = "Send";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  const row = document.createElement("div");
  row.className = "edit-buttons";
  row.append(resend, cancel);
  body.append(area, row);
  area.focus();
  const commit = () => {
    const text = area.value.trim();
    if (!text) return;
    c.messages = c.messages.slice(0, index);
    c.messages.push({ role: "user", content: text });
    save();
    renderAll();
    complete(c);
  };
  resend.addEventListener("click", commit);
  cancel.addEventListener("click", renderAll);
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); commit(); }
    if (e.key === "Escape") { e.preventDefault(); renderAll(); }
  });
}

function regenerate(c) {
  if (state.streaming) return;
  if (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  save();
  renderAll();
  complete(c);
}

// ---- sending and streaming -----------------------------------------------------------------------------------
function send() {
  if (state.streaming) return;
  const text = $("input").value.trim();
  if (!text) return;
  const c = conversation() || newConversation();
  if (!c.messages.length) c.title = text.split("\n")[0].slice(0, 60);
  c.messages.push({ role: "user", content: text });
  $("input").value = "";
  autosize();
  save();
  renderAll();
  complete(c);
}

function requestBody(c) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of c.messages) if (m.content) messages.push({ role: m.role, content: m.content });
  const body = { messages, stream: true, dflash: { origins: true } };
  if (state.model) body.model = state.model;
  const number = (id) => { const v = parseFloat($(id).value); return Number.isFinite(v) ? v : undefined; };
  body.temperature = number("temperature");
  body.top_p = number("top-p");
  const max = parseInt($("max-tokens").value, 10);
  if (max > 0) body.max_tokens = max;
  return body;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function complete(c) {
  const m = { role: "assistant", content: "", tokens: [], passes: [], partial: true };  // partial until finish()
  c.messages.push(m);
  const controller = new AbortController();
  state.controller = controller;
  state.streaming = { conversation: c, message: m, started: performance.now(), firstToken: null };
  renderAll();
  setStatus("waiting for the server…");
  let response;
  try {
    response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(c)), signal: controller.signal,
    });
  } catch (e) {
    return finish(m, e.name === "AbortError" ? null : `could not reach the server: ${e.message}`, e.name === "AbortError");
  }
  if (response.status === 401) {
    c.messages.pop();
    state.streaming = null;
    state.controller = null;
    renderAll();
    if (await askKey(true)) return complete(c);
    return;
  }
  if (!response.ok) {
    let text = `${response.status} ${response.statusText}`;
    try { const j = await response.json(); text = (j.error && j.error.message) || text; } catch (e) { /* not JSON */ }
    return finish(m, `the server answered: ${text}`);
  }
  setStatus("generating…");
  try {
    await readStream(response, m);
  } catch (e) {
    if (e.name === "AbortError") return finish(m, null, true);
    return finish(m, `the stream broke: ${e.message}`);
  }
  finish(m, null, controller.signal.aborted);
}

async function readStream(response, m) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data), m);
      }
    }
  }
}

function onChunk(chunk, m) {
  if (chunk.error) { m.error = chunk.error.message; return; }
  const choice = (chunk.choices || [])[0];
  const extra = chunk.dflash || {};
  if (extra.tokens && extra.tokens.length) {
    const stream = state.streaming;
    if (stream && stream.firstToken === null) stream.firstToken = performance.now();
    for (const t of extra.tokens) m.tokens.push([t.text, CODES[t.origin] || "t"]);
    m.passes.push(extra.tokens.length);
    saveSoon();
  }
  if (choice) {
    const delta = choice.delta || {};
    if (delta.content) m.content += delta.content;
    if (delta.reasoning_content) m.reasoning = (m.reasoning || "") + delta.reasoning_content;
    if (choice.finish_reason) {
      m.finish = choice.finish_reason;
      if (chunk.dflash) m.stats = statsOf(chunk.dflash);
    }
  }
  scheduleRender();
}

// What a finished reply keeps of the server's statistics.
function statsOf(d) {
  const keep = ["tau", "generation_tps", "acceptance_histogram", "origin_counts", "completion_tokens", "cycles",
                "accepted", "drafted", "time_to_first_token_s", "finish_reason"];
  const out = {};
  for (const k of keep) if (d[k] !== undefined) out[k] = d[k];
  return out;
}

// While a reply streams it is saved every few seconds (and when the page goes away), so a reload or a crashed tab
// keeps what had arrived.
let lastSave = 0;
function saveSoon() {
  const now = performance.now();
  if (now - lastSave < 2000) return;
  lastSave = now;
  save();
}

let renderQueued = false;
function scheduleRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => { renderQueued = false; renderStreaming(); });
}

function renderStreaming() {
  const stream = state.streaming;
  if (!stream) return;
  const c = stream.conversation;
  if (c.id !== state.current) return;
  const index = c.messages.indexOf(stream.message);
  const el = $("messages").querySelector(`article[data-index="${index}"]`);
  if (!el) return;
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  const m = stream.message;
  fillBody(el.querySelector(".body"), m);
  const elapsed = stream.firstToken === null ? 0 : (performance.now() - stream.firstToken) / 1000;
  const live = { tps: elapsed > 0 ? (m.tokens.length - 1) / elapsed : NaN };
  const old = el.querySelector(".stats");
  const stats = Render.renderStats(m, live);
  if (old) old.replaceWith(stats); else el.insertBefore(stats, el.querySelector(".actions"));
  el.classList.add("streaming");
  if (atBottom) box.scrollTop = box.scrollHeight;
  setStatus(`generating… ${m.tokens.length} tokens`);
}

function finish(m, error, stopped) {
  // The page is going away: its unload broke the stream. What was saved stays, marked partial for the next load.
  if (state.leaving) return;
  delete m.partial;
  if (error) m.error = error;
  if (stopped) m.stopped = true;
  state.streaming = null;
  state.controller = null;
  save();
  renderAll();
  setStatus(error ? "error" : stopped ? "stopped" : "");
  $("input").focus();
}

function stop() {
  if (state.controller) state.controller.abort();
}

// ---- API key -------------------------------------------------------------------------------------------------
function askKey(refused) {
  const dialog = $("key-dialog");
  $("key-error").hidden = !(refused && apiKey());
  $("key-input").value = "";
  return new Promise((resolve) => {
    const done = () => {
      dialog.removeEventListener("close", done);
      const key = $("key-input").value.trim();
      if (dialog.returnValue !== "cancel" && key) {
        localStorage.setItem(KEY, key);
        $("forget-key").hidden = false;
        loadModel();
        resolve(true);
      } else resolve(false);
    };
    dialog.addEventListener("close", done);
    dialog.returnValue = "";
    if (!dialog.open) dialog.showModal();
    $("key-input").focus();
  });
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) { askKey(true); return; }
    const j = await r.json();
    const card = j.data && j.data[0];
    if (card) {
      state.model = card.id;
      const d = card.dflash || {};
      $("model").textContent = card.id + (d.drafter ? ` · drafter: ${d.drafter}` : "");
    }
  } catch (e) {
    setStatus("could not reach the server", true);
  }
}

// ---- page chrome ---------------------------------------------------------------------------------------------
function setStatus(text, error) {
  const s = $("status");
  s.textContent = text || "";
  s.classList.toggle("error", !!error);
}

function updateButtons() {
  const busy = !!state.streaming;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function autosize() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight + 2, 240)}px`;
  input.style.overflowY = input.scrollHeight > 240 ? "auto" : "hidden";
}

function applyOriginToggle() {
  document.body.classList.toggle("hide-origins", !$("show-origins").checked);
}

function openSide() { document.body.classList.add("side-open"); }
function closeSide() { document.body.classList.remove("side-open"); }

function bind() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("input").addEventListener("input", autosize);
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.streaming) { e.preventDefault(); stop(); }
    if (e.key.toLowerCase() === "o" && e.shiftKey && (e.ctrlKey || e.metaKey)) { e.preventDefault(); newChat(); }
  });
  $("new-chat").addEventListener("click", newChat);
  window.addEventListener("pagehide", () => { state.leaving = true; if (state.streaming) save(); });
  window.addEventListener("pageshow", () => { state.leaving = false; });
  $("open-side").addEventListener("click", openSide);
  $("close-side").addEventListener("click", closeSide);
  for (const id of ["system-prompt", "temperature", "top-p", "max-tokens"]) $(id).addEventListener("change", saveSettings);
  $("show-origins").addEventListener("change", () => { applyOriginToggle(); saveSettings(); });
  $("forget-key").addEventListener("click", () => { localStorage.removeItem(KEY); $("forget-key").hidden = true; });
  $("forget-key").hidden = !apiKey();
  $("messages").addEventListener("click", (e) => {
    const button = e.target.closest(".copy-code");
    if (!button) return;
    copyText(button.parentElement.querySelector("code").textContent);
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1200);
  });
}

function newChat() {
  if (state.streaming) return;
  const c = conversation();
  if (!c || c.messages.length) newConversation();
  save();
  renderAll();
  closeSide();
  $("input").focus();
}

if (matchMedia("(max-width: 760px)").matches) $("input").placeholder = "Message";  // the hints fit no phone
load();
bind();
renderAll();
loadModel();
