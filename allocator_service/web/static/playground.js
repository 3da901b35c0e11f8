// /playground: the page keeps the list of operations clicked so far and
// sends it whole to /playground/api/run, which applies it to a fresh pool
// of the real allocator core; the page only draws the answer.
"use strict";
const $ = (id) => document.getElementById(id);
// The reference article's hand-worked table (tests/traces/article_table.jsonl),
// as the clicks that make it.
const ARTICLE = [
  { label: "A arrives with a 6-token prompt", act: () => addChat(6) },
  { label: "B arrives with 3 tokens", act: () => addChat(3) },
  { label: "C arrives with 5 tokens", act: () => addChat(5) },
  { label: "A generates 2 tokens", act: () => grow("A", 2) },
  { label: "A generates 1 token", act: () => grow("A", 1) },
  { label: "B generates 2 tokens", act: () => grow("B", 2) },
  { label: "B finishes", act: () => free("B") },
  { label: "C generates 4 tokens", act: () => grow("C", 4) },
];
let ops = [], labels = [], nextToken = 1, nextName = 0, articleStep = 0, last = null, inArticle = false;
const chatTokens = new Map(); // chat -> its token ids (to share a prompt)

function settings() {
  return {
    num_blocks: Number($("num-blocks").value), block_size: Number($("block-size").value),
    prefix_caching: $("prefix").checked, reserve: Number($("reserve").value),
  };
}
function freshTokens(n) { const t = []; for (let i = 0; i < n; i++) t.push(nextToken++); return t; }
function newName() {
  let name;
  do { name = nextName < 26 ? String.fromCharCode(65 + nextName) : "S" + nextName; nextName++; }
  while (chatTokens.has(name) || (last && last.paged.tables[name]));
  return name;
}

async function run(op, label) {
  const body = { ...settings(), ops: op ? [...ops, op] : ops };
  const r = await fetch("/playground/api/run", { method: "POST", headers: { "Content-Type": "application/json" },
                                                 body: JSON.stringify(body) });
  const answer = await r.json();
  if (!r.ok) { $("status").textContent = answer.error; $("status").className = "status err"; return false; }
  if (op) { ops.push(op); labels.push(label); }
  if (op && !inArticle && articleStep) {  // a click of one's own: the article's table starts over
    articleStep = 0;
    $("article").textContent = "article's table: start over";
  }
  last = answer;
  draw(answer);
  return true;
}

function addChat(n) {
  const name = newName();
  const share = $("share").value;
  let tokens = freshTokens(n ?? Number($("prompt").value));
  if (share && chatTokens.has(share)) tokens = [...chatTokens.get(share), ...tokens];
  chatTokens.set(name, tokens);
  return run({ op: "admit", seq: name, tokens }, `${name} arrives with ${tokens.length} tokens`);
}
function grow(seq, n) {
  const tokens = freshTokens(n ?? Number($("n").value));
  chatTokens.set(seq, [...(chatTokens.get(seq) || []), ...tokens]);
  return run({ op: "append", seq, tokens }, `${seq} generates ${tokens.length} token${tokens.length === 1 ? "" : "s"}`);
}
function fork(parent) {
  const child = newName();
  chatTokens.set(child, [...(chatTokens.get(parent) || [])]);
  return run({ op: "fork", parent, child }, `${parent} forks into ${child}`);
}
function free(seq) { return run({ op: "free", seq }, `${seq} finishes`); }
function reset() {
  ops = []; labels = []; nextToken = 1; nextName = 0; articleStep = 0; chatTokens.clear();
  $("article").textContent = "article's table: next step";
  return run(null);
}

function draw(a) {
  const p = a.paged, c = a.contiguous, last = a.results.at(-1);
  const st = $("status");
  st.className = "status" + (last && !last.ok ? " err" : "");
  st.textContent = last ? (last.ok ? `${labels.at(-1)}: ok` + (last.new_blocks.length ? `, new blocks [${last.new_blocks}]` : "") +
    (last.copies.length ? `, copies ${JSON.stringify(last.copies)}` : "") + (last.cached_tokens ? `, ${last.cached_tokens} tokens from the cache` : "")
    : `${labels.at(-1)}: ${last.error} (${last.message}); nothing changed`) : "";
  // chats
  const names = Object.keys(p.tables);
  $("chats").innerHTML = names.map((s) => {
    const [bg, fg] = seqColour(s);
    return `<div class="chat" data-chat="${esc(s)}"><span class="seq"><span class="sw" style="background:${bg}"></span>` +
      `${esc(s)}: <b>${p.tokens[s]}</b> tokens</span>` +
      `<button class="ctl" data-act="grow1" data-seq="${esc(s)}">+1 token</button>` +
      `<button class="ctl" data-act="growN" data-seq="${esc(s)}">+N tokens</button>` +
      `<button class="ctl" data-act="fork" data-seq="${esc(s)}">fork</button>` +
      `<button class="ctl" data-act="free" data-seq="${esc(s)}">free</button></div>`;
  }).join("") || `<span class="status">No chat yet: add one.</span>`;
  const share = $("share"), keep = share.value;
  share.innerHTML = `<option value="">no chat</option>` + names.map((s) => `<option>${esc(s)}</option>`).join("");
  share.value = names.includes(keep) ? keep : "";
  // paged
  const pe = $("paged");
  Object.assign(pe.dataset, { usedBlocks: p.used_blocks, cachedBlocks: p.cached_blocks, freeBlocks: p.free_blocks,
    usedSlots: p.used_slots, wasted: p.wasted_slots, tables: JSON.stringify(p.tables), free: JSON.stringify(p.free),
    refcounts: JSON.stringify(p.refcounts) });
  $("paged-stats").innerHTML = `<span><b>${p.used_slots}</b> slots used</span><span><b>${p.wasted_slots}</b> wasted</span>` +
    `<span><b>${p.used_blocks}</b> blocks in use, <b>${p.cached_blocks}</b> cached, <b>${p.free_blocks}</b> free</span>` +
    (p.prefix_caching ? `<span>hit rate <b>${(100 * p.hit_rate).toFixed(0)}%</b></span>` : "");
  $("paged-blocks").innerHTML = p.blocks.map((b) => {
    let slots = "";
    const owner = b.owners[0];
    for (let i = 0; i < p.block_size; i++) {
      let style = "";
      if (b.state === "used") {
        const [bg] = seqColour(owner);
        style = `background:${bg}${i < b.fill ? "" : ";opacity:.3"}`;
      }
      slots += `<span class="slot" style="${style}"></span>`;
    }
    const badge = b.ref > 1 ? ` ×${b.ref}` : "";
    const who = b.state === "used" ? b.owners.join(", ") : b.state === "cached" ? `cached, ${b.evict_rank === 0 ? "evicted next" : "free"}` : "free";
    return `<div class="blk ${b.state}" data-block="${b.id}" data-state="${b.state}" title="block ${b.id}: ${esc(who)}">` +
      `<span class="id">${b.id}${badge}</span><span class="row">${slots}</span></div>`;
  }).join("");
  $("paged-tables").textContent = "tables: " + (names.map((s) => `${s}: [${p.tables[s].join(", ")}]`).join("; ") || "none") +
    "  |  free list: " + (p.free.join(" ") || "empty");
  // contiguous
  const ce = $("contig");
  Object.assign(ce.dataset, { used: c.used, wasted: c.wasted, free: c.free, waiting: JSON.stringify(c.waiting) });
  $("contig-stats").innerHTML = `<span><b>${c.used}</b> slots used</span><span><b>${c.wasted}</b> wasted</span>` +
    `<span><b>${c.free}</b> free in ${c.free_runs.length} run${c.free_runs.length === 1 ? "" : "s"}` +
    (c.free_runs.length ? ` (longest ${Math.max(...c.free_runs.map((r) => r[1]))})` : "") + `</span>` +
    (c.waiting.length ? `<span class="err">shut out: <b>${c.waiting.map(esc).join(", ")}</b></span>` : "");
  const slots = new Array(c.slots).fill("");
  for (const [rid, r] of Object.entries(c.requests)) {
    const [bg] = seqColour(rid);
    for (let i = 0; i < r.reserved; i++) slots[r.start + i] = `background:${bg}${i < r.used ? "" : ";opacity:.3"}" title="${esc(rid)}`;
  }
  $("contig-slots").innerHTML = slots.map((s) => `<span class="slot" style="${s}"></span>`).join("");
  $("contig-lines").textContent = Object.entries(c.requests).map(([rid, r]) =>
    `${rid}: slots ${r.start}-${r.start + r.reserved - 1}, ${r.used} used` + (r.tokens > r.reserved ? ` (needs ${r.tokens}: over its reservation)` : "")).join("; ");
  // log: each row is the server's view after that step
  const fmt = (o) => Object.keys(o.tables).map((s) => `${s}: [${o.tables[s].join(", ")}]`).join("; ") || "none";
  $("log").querySelector("tbody").innerHTML = `<tr><td>0</td><td>start</td><td>none</td><td>none</td>` +
    `<td>${[...Array(p.num_blocks).keys()].join(" ")}</td><td>0</td></tr>` +
    a.results.map((r, i) => `<tr data-step="${i + 1}" data-ok="${r.ok}" data-wasted="${r.wasted_slots}" ` +
      `data-tables="${esc(JSON.stringify(r.tables))}" data-free="${esc(JSON.stringify(r.free))}"><td>${i + 1}</td>` +
      `<td>${esc(labels[i] || "")}${r.ok ? "" : " (" + esc(r.error) + ")"}</td>` +
      `<td>${Object.entries(r.tokens).map(([s, n]) => `${esc(s)} ${n}`).join(", ") || "none"}</td>` +
      `<td>${esc(fmt(r))}</td><td>${r.free.join(" ")}</td><td>${r.wasted_slots}</td></tr>`).join("");
  document.body.dataset.steps = String(a.results.length);
}

$("chats").addEventListener("click", (ev) => {
  const b = ev.target.closest("button");
  if (!b) return;
  const s = b.dataset.seq;
  ({ grow1: () => grow(s, 1), growN: () => grow(s), fork: () => fork(s), free: () => free(s) })[b.dataset.act]();
});
$("add").addEventListener("click", () => addChat());
$("article").addEventListener("click", async () => {
  if (articleStep === 0 && ops.length) await reset();
  if (articleStep >= ARTICLE.length) { await reset(); return; }
  const step = ARTICLE[articleStep++];
  inArticle = true;
  try { await step.act(); } finally { inArticle = false; }
  $("article").textContent = articleStep < ARTICLE.length ? `article's table: step ${articleStep + 1} (${ARTICLE[articleStep].label})` : "article's table: done (again)";
});
$("reset").addEventListener("click", reset);
for (const id of ["num-blocks", "block-size", "prefix", "reserve"]) {
  $(id).addEventListener("change", () => {
    const slots = Number($("num-blocks").value) * Number($("block-size").value);
    $("reserve").max = String(slots);
    if (Number($("reserve").value) > slots) $("reserve").value = String(slots);
    $("reserve-out").textContent = $("reserve").value;
    run(null);  // the same clicks on the new shape
  });
}
$("reserve").addEventListener("input", () => { $("reserve-out").textContent = $("reserve").value; });
window.pagedkvPlayground = { addChat, grow, fork, free, reset, ops: () => ops };
reset();
