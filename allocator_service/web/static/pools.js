// /pools: every pool as a grid of blocks, kept live from /pools/stream
// (server-sent events: `init` per pool, then `blocks` with the changed
// blocks only, `kv` with the allocator's KV event counts, `drop`).
"use strict";
const FREE = 0, CACHED = 1, USED = 2;
const STATE_NAME = ["free", "cached", "used"];
const CELL_LIMIT = 4096;     // at most this many block cells; above it, grouped cells
const GROUPED_CELLS = 2048;  // how many grouped cells a large pool shows
const HISTORY = 60;          // sparkline samples (one a second)

const params = new URLSearchParams(location.search);
const token = params.get("token");
const pools = new Map();
const main = document.getElementById("pools");
const statusEl = document.getElementById("status");

function authed(url) {
  if (!token) return url;
  return url + (url.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token);
}

function newPool(msg) {
  const el = document.createElement("section");
  el.className = "pool";
  el.dataset.pool = msg.pool;
  const role = esc(msg.kv_role || "both");  // its part in prefill/decode disaggregation
  el.innerHTML =
    `<header><h2>${esc(msg.pool)}</h2><span class="role" data-kv-role="${role}">${role}</span>` +
    `<span class="stats"></span>` +
    `<span class="status">in use, last minute</span><svg class="spark" width="120" height="24" role="img" aria-label="blocks in use, last minute">` +
    `<rect x="0" y="0" width="120" height="24" fill="#f6f8fa" stroke="#d0d7de"/>` +
    `<polyline fill="none" stroke="#0b5cad" stroke-width="1.5" points=""/></svg>` +
    `<span class="zoom-note status"></span><button class="ctl zoom-out" hidden>zoom out</button></header>` +
    `<div class="seqs" aria-label="sequences"></div><div class="table-line" aria-live="polite"></div>` +
    `<div class="grid" role="img"></div>`;
  main.appendChild(el);
  document.getElementById("empty")?.remove();
  const p = { id: msg.pool, el, state: [], owner: [], ref: [], counters: {}, rank: new Map(),
              history: [], zoom: null, selected: null, table: [], dirty: false, fetchAt: 0 };
  el.querySelector(".grid").addEventListener("click", (ev) => onCell(p, ev));
  el.querySelector(".seqs").addEventListener("click", (ev) => {
    const b = ev.target.closest(".seq");
    if (b) select(p, b.dataset.seq === p.selected ? null : b.dataset.seq);
  });
  el.querySelector(".zoom-out").addEventListener("click", () => { p.zoom = null; schedule(p); });
  return p;
}

function setCounters(p, c) {
  p.counters = c;
  if (c.cached_order) p.rank = new Map(c.cached_order.map((b, i) => [b, i]));
  else p.rank = new Map();
}

function onInit(msg) {
  const p = pools.get(msg.pool) || newPool(msg);
  pools.set(msg.pool, p);
  p.state = msg.state; p.owner = msg.owner; p.ref = msg.ref;
  setCounters(p, msg.counters);
  if (!p.history.length) sample(p);
  schedule(p);
}

function onBlocks(msg) {
  const p = pools.get(msg.pool);
  if (!p) return;
  for (const [b, s, o, r] of msg.blocks) { p.state[b] = s; p.owner[b] = o; p.ref[b] = r; }
  setCounters(p, msg.counters);
  if (p.selected) refreshTable(p);
  schedule(p);
}

function counts(p) {
  const n = [0, 0, 0];
  for (const s of p.state) n[s]++;
  return n;
}

function schedule(p) {
  if (p.dirty) return;
  p.dirty = true;
  setTimeout(() => render(p), 16);  // one render per burst of messages
}
function renderAll() { for (const p of pools.values()) render(p); }

function cellHtml(p, b) {
  const s = p.state[b], cls = STATE_NAME[s];
  let style = "", text = "", title = `block ${b}: ${cls}`;
  if (s === USED) {
    const [bg, fg] = seqColour(p.owner[b] || "?");
    style = `background:${bg};color:${fg}`;
    title += ` by ${p.owner[b]}`;
    if (p.ref[b] > 1) { text = String(p.ref[b]); title += `, shared by ${p.ref[b]} tables`; }
  } else if (s === CACHED && p.rank.size) {
    const r = p.rank.get(b) ?? 0, k = p.rank.size;
    style = `opacity:${(0.45 + 0.55 * (k > 1 ? r / (k - 1) : 1)).toFixed(2)}`;
    title += `, evicted ${r === 0 ? "next" : "after " + r + " others"}`;
  }
  const pos = p.table.indexOf(b);
  const hl = pos >= 0 ? " hl" : (p.selected ? " dim" : "");
  if (pos >= 0) { text = String(pos); title += `, entry ${pos} of ${p.selected}'s table`; }
  return `<div class="b ${cls}${p.ref[b] > 1 ? " shared" : ""}${hl}" data-b="${b}" title="${esc(title)}"` +
         ` style="${style}">${text}</div>`;
}

// The KV tiers below the pool, when it has any: the host tier, the shared store.
function tierStats(t) {
  if (!t) return "";
  let out = "";
  if (t.host_blocks) {
    out += `<span data-tier="host">host tier <b>${t.host_used}</b> of <b>${t.host_blocks}</b> slots, ` +
           `<b>${t.host_hit_tokens}</b> tokens loaded, <b>${t.host_saves}</b> saves</span>`;
  }
  if (t.shared_store) {
    out += `<span data-tier="shared">shared store <b>${(t.store_used_bytes / 2 ** 20).toFixed(1)}</b> MiB used, ` +
           `<b>${t.store_hit_tokens}</b> tokens loaded, <b>${t.store_saves}</b> saves, <b>${t.refused}</b> refused</span>`;
  }
  return out;
}

function render(p) {
  p.dirty = false;
  const n = p.state.length, [free, cached, used] = counts(p), c = p.counters;
  const el = p.el;
  Object.assign(el.dataset, { blocks: n, used, cached, free, sequences: c.sequences });
  const q = c.prefix_queried_tokens, hit = q ? (100 * c.prefix_hit_tokens / q).toFixed(1) + "%" : "n/a";
  el.querySelector(".stats").innerHTML =
    `<span><b data-count="used">${used}</b> in use</span>` +
    `<span><b data-count="cached">${cached}</b> cached</span>` +
    `<span><b data-count="free">${free}</b> free</span>` +
    `<span>of <b>${n}</b> blocks × ${c.block_size} slots</span>` +
    `<span><b>${c.sequences}</b> sequence${c.sequences === 1 ? "" : "s"}, <b>${c.tokens}</b> tokens</span>` +
    `<span>hit rate <b>${hit}</b>${c.prefix_caching ? "" : " (prefix caching off)"}</span>` +
    `<span><b>${c.evictions}</b> evictions</span><span><b>${c.copies}</b> copies</span>` +
    `<span><b>${c.out_of_blocks}</b> out of blocks</span>` + tierStats(c.tiers);
  // sequences, in order of their first block
  const seen = new Map();
  for (let b = 0; b < n && seen.size < 200; b++) if (p.state[b] === USED && p.owner[b] && !seen.has(p.owner[b])) seen.set(p.owner[b], 1);
  el.querySelector(".seqs").innerHTML = [...seen.keys()].map((s) => {
    const [bg] = seqColour(s);
    return `<button class="seq" data-seq="${esc(s)}" aria-pressed="${s === p.selected}">` +
           `<span class="sw" style="background:${bg}"></span>${esc(s)}</button>`;
  }).join("") + (c.sequences > seen.size ? `<span class="status">and ${c.sequences - seen.size} more</span>` : "");
  // grid
  const grid = el.querySelector(".grid");
  let html = "";
  if (n <= CELL_LIMIT || p.zoom !== null) {
    const lo = p.zoom ?? 0, hi = Math.min(n, lo + CELL_LIMIT);
    for (let b = lo; b < hi; b++) html += cellHtml(p, b);
    grid.setAttribute("aria-label", `blocks ${lo} to ${hi - 1}`);
    el.querySelector(".zoom-out").hidden = p.zoom === null;
    el.querySelector(".zoom-note").textContent = p.zoom === null ? "" : `showing blocks ${lo} to ${hi - 1} of ${n}`;
  } else {
    const per = Math.ceil(n / GROUPED_CELLS);
    for (let lo = 0; lo < n; lo += per) {
      const k = [0, 0, 0], hi = Math.min(n, lo + per);
      for (let b = lo; b < hi; b++) k[p.state[b]]++;
      const s = k[USED] >= k[CACHED] && k[USED] >= k[FREE] ? USED : (k[CACHED] >= k[FREE] ? CACHED : FREE);
      const share = (k[USED] / (hi - lo));
      const style = s === USED ? `background:rgb(0,${Math.round(114 - 60 * share)},${Math.round(178 - 80 * share)})` : "";
      html += `<div class="b agg ${STATE_NAME[s]}" data-lo="${lo}" style="${style}" ` +
              `title="blocks ${lo} to ${hi - 1}: ${k[USED]} in use, ${k[CACHED]} cached, ${k[FREE]} free"></div>`;
    }
    grid.setAttribute("aria-label", `${n} blocks, ${per} to a cell; click a cell to zoom`);
    el.querySelector(".zoom-note").textContent = `${per} blocks to a cell (colour: what most of them are); click one to zoom`;
  }
  grid.innerHTML = html;
  el.dataset.renderedAt = String(Date.now());
}

function onCell(p, ev) {
  const cell = ev.target.closest(".b");
  if (!cell) return;
  if (cell.dataset.lo !== undefined) {
    p.zoom = Math.max(0, Number(cell.dataset.lo) - CELL_LIMIT / 2 + 1);
    schedule(p);
  } else if (p.state[Number(cell.dataset.b)] === USED) {
    select(p, p.owner[Number(cell.dataset.b)]);
  }
}

function select(p, seq) {
  p.selected = seq; p.table = [];
  p.el.querySelector(".table-line").textContent = "";
  if (seq) refreshTable(p, true);
  schedule(p);
}

async function refreshTable(p, now) {
  const t = Date.now();
  if (!now && t - p.fetchAt < 500) return;
  p.fetchAt = t;
  const seq = p.selected;
  const r = await fetch(authed(`/pools/api/table?pool=${encodeURIComponent(p.id)}&seq=${encodeURIComponent(seq)}`));
  if (p.selected !== seq) return;
  const line = p.el.querySelector(".table-line");
  if (!r.ok) { p.table = []; line.textContent = `${seq}: finished`; schedule(p); return; }
  const t2 = await r.json();
  p.table = t2.table;
  if (p.zoom === null && p.state.length > CELL_LIMIT && p.table.length) p.zoom = Math.max(0, p.table[0] - 8);
  line.textContent = `${seq}: ${t2.tokens} tokens, table [${t2.table.join(", ")}]` +
    (t2.refcounts.some((x) => x > 1) ? `, refcounts [${t2.refcounts.join(", ")}]` : "");
  schedule(p);
}

function sample(only) {
  for (const p of only ? [only] : pools.values()) {
    const n = p.state.length;
    if (!n) continue;
    p.history.push(counts(p)[USED] / n);
    if (p.history.length > HISTORY) p.history.shift();
    const k = p.history.length;  // newest at the right edge
    const pts = p.history.map((v, i) => `${(120 - (k - 1 - i) * 120 / (HISTORY - 1)).toFixed(1)},${(22 - 20 * v).toFixed(1)}`);
    p.el.querySelector(".spark polyline").setAttribute("points", pts.join(" "));
    p.el.querySelector(".spark").setAttribute("aria-label", `blocks in use, last minute: now ${(100 * p.history.at(-1)).toFixed(0)}%`);
  }
}
setInterval(sample, 1000);

const es = new EventSource(authed("/pools/stream"));
let kvEvents = 0;
es.addEventListener("open", () => { statusEl.textContent = "live"; document.body.dataset.connected = "1"; });
es.addEventListener("error", () => { statusEl.textContent = "reconnecting…"; });
es.addEventListener("init", (e) => onInit(JSON.parse(e.data)));
es.addEventListener("blocks", (e) => onBlocks(JSON.parse(e.data)));
es.addEventListener("kv", (e) => {
  for (const c of Object.values(JSON.parse(e.data))) for (const v of Object.values(c)) kvEvents += v;
  document.body.dataset.kvEvents = String(kvEvents);
  statusEl.textContent = `live; ${kvEvents} KV events`;
});
es.addEventListener("drop", (e) => {
  const id = JSON.parse(e.data).pool, p = pools.get(id);
  if (p) { p.el.remove(); pools.delete(id); }
});
window.pagedkvPools = { pools, renderAll };
