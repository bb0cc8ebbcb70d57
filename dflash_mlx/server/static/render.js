// Rendering a reply: markdown (marked) with highlighted code (highlight.js), every token marked by its origin,
// and the reply's speculation statistics (tok/s, tau, acceptance histogram).
"use strict";

const ORIGIN_NAMES = { d: "drafter", l: "lookup", t: "target" };
const ORIGIN_TITLES = { d: "accepted from the drafter", l: "copied by prompt lookup", t: "the target's own token" };

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

// Raw HTML in a reply is shown as text, never run; code blocks are highlighted.
marked.use({
  gfm: true,
  breaks: false,
  renderer: {
    html(token) { return escapeHtml(token.text || token.raw || ""); },
    code(token) {
      const lang = (token.lang || "").split(/\s/)[0];
      let html;
      try {
        html = lang && hljs.getLanguage(lang) ? hljs.highlight(token.text, { language: lang }).value
                                              : hljs.highlightAuto(token.text).value;
      } catch (e) {
        html = escapeHtml(token.text);
      }
      const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "";
      return `<div class="code-block">${label}<button class="copy-code" type="button">Copy</button>` +
             `<pre><code class="hljs">${html}</code></pre></div>`;
    },
  },
});

function renderMarkdown(text) {
  return marked.parse(text);
}

// The text each token added, concatenated, and for each character the index of its token.
function tokenText(tokens) {
  let raw = "";
  const owner = [];
  tokens.forEach(([text], i) => {
    raw += text;
    for (let k = 0; k < text.length; k++) owner.push(i);
  });
  return { raw, owner };
}

// Wraps the rendered text in spans, one per run of a token's characters, classed by the token's origin.
// Markdown drops its syntax (`#`, `*`, fences) and keeps the order of the rest, so each rendered character is
// matched to the next equal character of the tokens' text, looking a little ahead; unmatched ones (whitespace
// the renderer added) join the run before them.
function markOrigins(root, tokens) {
  if (!tokens || !tokens.length) return;
  const { raw, owner } = tokenText(tokens);
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT, {
    acceptNode: (n) => (n.parentElement && n.parentElement.closest(".code-lang, .copy-code"))
      ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT,
  });
  const nodes = [];
  while (walker.nextNode()) nodes.push(walker.currentNode);
  let at = 0;
  let last = 0;
  for (const node of nodes) {
    const text = node.nodeValue;
    if (!text) continue;
    const runs = [];
    for (let i = 0; i < text.length; i++) {
      const ch = text[i];
      let found = -1;
      for (let k = at; k < Math.min(raw.length, at + 32); k++) {
        if (raw[k] === ch) { found = k; break; }
      }
      if (found < 0 && i + 4 <= text.length) {
        // Far ahead (text the body does not show, such as the reply's reasoning): find the next few characters.
        const k = raw.indexOf(text.slice(i, i + 12), at);
        if (k >= 0) found = k;
      }
      let token = last;
      if (found >= 0) { token = owner[found]; at = found + 1; last = token; }
      const run = runs[runs.length - 1];
      if (run && run.token === token) run.end = i + 1;
      else runs.push({ token, start: i, end: i + 1 });
    }
    const frag = document.createDocumentFragment();
    for (const run of runs) {
      const code = tokens[run.token][1];
      const span = document.createElement("span");
      span.className = "tok o-" + ORIGIN_NAMES[code];
      span.dataset.token = String(run.token);
      span.title = ORIGIN_TITLES[code];
      span.textContent = text.slice(run.start, run.end);
      frag.appendChild(span);
    }
    node.parentNode.replaceChild(frag, node);
  }
}

function countOrigins(tokens) {
  const counts = { drafter: 0, lookup: 0, target: 0 };
  for (const [, code] of tokens || []) counts[ORIGIN_NAMES[code]] += 1;
  return counts;
}

// Tokens committed per verify pass -> passes, from the reply's passes (each streamed delta is one pass).
function passHistogram(passes) {
  const histogram = {};
  for (const n of passes || []) histogram[n] = (histogram[n] || 0) + 1;
  return histogram;
}

function renderHistogram(histogram) {
  const box = document.createElement("div");
  box.className = "histogram";
  box.title = "Tokens committed per verify pass (accepted drafts + 1) -> passes";
  const keys = Object.keys(histogram || {}).map(Number);
  if (!keys.length) return box;
  const top = Math.max(...Object.values(histogram));
  const longest = Math.max(...keys);
  for (let n = 1; n <= longest; n++) {
    const count = histogram[n] || 0;
    const col = document.createElement("div");
    col.className = "bar";
    col.title = `${count} pass${count === 1 ? "" : "es"} committed ${n} token${n === 1 ? "" : "s"}`;
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.height = `${count ? Math.max(2, Math.round((20 * count) / top)) : 0}px`;
    const label = document.createElement("span");
    // Two-digit labels do not fit under every bar of a long histogram: 1, every fourth, and the last.
    label.textContent = longest <= 9 || n === 1 || n === longest || n % 4 === 0 ? String(n) : "";
    col.append(fill, label);
    box.appendChild(col);
  }
  return box;
}

function fmt(value, digits) {
  return Number.isFinite(value) ? value.toFixed(digits) : "–";
}

// The line under a reply: tok/s, tau, token counts by origin and the acceptance histogram.
function renderStats(message, live) {
  const box = document.createElement("div");
  box.className = "stats";
  const counts = countOrigins(message.tokens);
  const passes = message.passes || [];
  const n = (message.tokens || []).length;
  const s = message.stats || {};
  const tps = s.generation_tps !== undefined ? s.generation_tps : live && live.tps;
  const tau = s.tau !== undefined ? s.tau : (passes.length ? n / passes.length : NaN);
  const parts = [
    ["tps", `${fmt(tps, 1)} tok/s`, "tokens per second (generation)"],
    ["tau", `τ ${fmt(tau, 2)}`, "tokens committed per verify pass"],
    ["tokens", `${n} tokens`, "tokens in this reply"],
    ["drafter", `${counts.drafter}`, "accepted from the drafter"],
    ["lookup", `${counts.lookup}`, "copied by prompt lookup"],
    ["target", `${counts.target}`, "the target's own tokens"],
  ];
  for (const [key, text, title] of parts) {
    const span = document.createElement("span");
    span.className = "stat stat-" + key;
    if (["drafter", "lookup", "target"].includes(key)) {
      const dot = document.createElement("span");
      dot.className = "swatch o-" + key;
      span.appendChild(dot);
    }
    span.appendChild(document.createTextNode(text));
    span.title = title;
    box.appendChild(span);
  }
  box.dataset.drafter = counts.drafter;
  box.dataset.lookup = counts.lookup;
  box.dataset.target = counts.target;
  const histogram = s.acceptance_histogram || passHistogram(passes);
  box.appendChild(renderHistogram(histogram));
  if (message.stopped || message.finish === "length") {
    const tag = document.createElement("span");
    tag.className = message.stopped ? "stat stopped" : "stat cut";
    tag.textContent = message.interrupted ? "interrupted" : message.stopped ? "stopped" : "cut at the max tokens";
    tag.title = message.interrupted ? "the page was reloaded or closed while this reply streamed"
      : message.stopped ? "you stopped this reply" : "the reply reached the Max tokens setting";
    box.appendChild(tag);
  }
  return box;
}

window.Render = { renderMarkdown, markOrigins, renderStats, countOrigins, escapeHtml };
