// agentrl viewer: the run table, one tree, the token view of a turn, curves, and a
// side-by-side of two steps. Plain DOM and SVG; no library, no network.
// Data comes from the page itself (--static: JSON in <script type="application/json">
// elements, parsed only when a tree is opened) or from the local server (/api/...).
// Every string from a run (model output, observations) goes in through textContent,
// never innerHTML.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const PAGE_ROWS = 50;
const MAX_CACHED_TREES = 24;
const PENDING_RETRY_MS = 1000;  // a tree served before the tokenizer was ready is asked for again
const FIRST_STEP_POLL_MS = 2000;  // a run served before its first step is asked for again

const S = {
  mode: document.body.dataset.mode || "static",
  run: null,
  cache: new Map(),          // tree index -> payload (least recently used first)
  cacheBytes: 256 * 2 ** 20, // and at most this much of their JSON text (as the server keeps)
  tree: null, treeIndex: null,
  node: null, leaf: null,
  tokenMode: "mask", showContext: true,
  sort: { key: "index", asc: true }, page: 0,
  filter: { text: "", step: "", outcome: "", family: "" },
  compare: { a: null, b: null },
};

// --------------------------------------------------------------------------- helpers

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    e.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return e;
}

function svg(tag, attrs, ...kids) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const kid of kids.flat()) if (kid) e.append(kid);
  return e;
}

const fmt = (x, d = 3) => (x === null || x === undefined || Number.isNaN(x)) ? "–"
  : (typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(d)) : String(x));
const sfmt = (x, d = 3) => (x === null || x === undefined) ? "–" : (x > 0 ? "+" : "") + x.toFixed(d);
const mean = (xs) => { const v = xs.filter((x) => x !== null && x !== undefined); return v.length ? v.reduce((a, b) => a + b, 0) / v.length : null; };
const short = (s, n) => { s = String(s || "").replace(/\s+/g, " ").trim(); return s.length > n ? s.slice(0, n - 1) + "…" : s; };
const $ = (id) => document.getElementById(id);
const put = (parent, ...kids) => parent.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
// Smallest and largest of xs by a loop: Math.min(...xs) passes each value as an argument,
// and V8 throws RangeError past ~125k of them (a turn of that many tokens, a long run's curve).
function extent(xs, lo = Infinity, hi = -Infinity) {
  for (const x of xs) { if (x < lo) lo = x; if (x > hi) hi = x; }
  return [lo, hi];
}
const compact = (x) => Math.abs(x) >= 1e4 ? (x / 1e3).toFixed(Math.abs(x) >= 1e5 ? 0 : 1) + "k" : null;

// --------------------------------------------------------------------------- data

async function loadRun() {
  if (S.mode === "server") {
    const r = await fetch("api/run");
    if (!r.ok) throw new Error("api/run: " + r.status + " " + (await r.text()));  // the server says why
    return r.json();
  }
  return JSON.parse($("run-data").textContent);
}

async function loadTree(i) {
  i = Number(i);
  if (S.cache.has(i)) {
    const t = S.cache.get(i); S.cache.delete(i); S.cache.set(i, t); return t;
  }
  let t;
  if (S.mode === "server") {
    // the index's generation: the server refuses a tree of an index it has since rebuilt
    const r = await fetch("api/tree/" + i + (S.run.generation !== undefined ? "?generation=" + S.run.generation : ""));
    if (!r.ok) throw new Error("api/tree/" + i + ": " + r.status + " " + (await r.text()));
    const text = await r.text();
    t = JSON.parse(text);
    t._bytes = text.length;
  } else {
    const node = $("tree-" + i);
    if (!node) throw new Error("tree " + i + " is not in this page (written with a limit?)");
    t = JSON.parse(node.textContent);
    if (t.error) throw new Error(t.error);  // --static wrote why this tree could not be drawn
    t._bytes = node.textContent.length;
  }
  if (t.tokens_pending) return t;  // ids only, for now: not kept (awaitTokens asks again)
  S.cache.set(i, t);
  // a count alone let 24 trees of 100 MB (20,000-turn episodes) take a tab past 2 GB; the
  // newest stays whatever its size: it is the one on screen
  let held = 0;
  for (const c of S.cache.values()) held += c._bytes || 0;
  while (S.cache.size > 1 && (S.cache.size > MAX_CACHED_TREES || held > S.cacheBytes)) {
    const oldest = S.cache.keys().next().value;
    held -= S.cache.get(oldest)._bytes || 0;
    S.cache.delete(oldest);
  }
  return t;
}

function nodeOf(tree, id) { return tree.nodes[tree._pos ? tree._pos.get(Number(id)) : 0]; }
function prepare(tree) {
  if (!tree._pos) tree._pos = new Map(tree.nodes.map((n, k) => [n.id, k]));
  return tree;
}

// --------------------------------------------------------------------------- tabs and routing

function show(view) {
  for (const s of document.querySelectorAll("main > section")) s.hidden = s.id !== "view-" + view;
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.view === view);
  S.view = view;
}

function setHash() {
  let h = S.view || "run";
  if ((S.view === "tree" || S.view === "tokens") && S.treeIndex !== null) {
    h += "=" + S.treeIndex + (S.node !== null ? "&node=" + S.node : "") + (S.leaf !== null ? "&leaf=" + S.leaf : "");
  } else if (S.view === "compare" && S.compare.a !== null) {
    h += "=" + S.compare.a + "," + S.compare.b;
  }
  history.replaceState(null, "", "#" + h);
}

async function route() {
  const h = location.hash.slice(1);
  const view = h.split("=")[0];
  const rest = h.slice(view.length + 1);
  const first = rest.split("&")[0];
  const params = new URLSearchParams(rest.split("&").slice(1).join("&"));
  if ((view === "tree" || view === "tokens") && first !== "") {
    const nd = params.get("node");
    await openTree(Number(first), nd === null ? null : nd === "prompt" ? "prompt" : Number(nd),
      params.has("leaf") ? Number(params.get("leaf")) : null, view);
  } else if (view === "compare") {
    const [a, b] = first.split(",").map(Number);
    await openCompare(Number.isFinite(a) ? a : null, Number.isFinite(b) ? b : null);
  } else if (view === "curves") { show("curves"); }
  else { show("run"); }
}

// --------------------------------------------------------------------------- the run table

const COLUMNS = [
  ["index", "#", (s) => s.index, "num"],
  ["step", "step", (s) => fmt(s.step), "num"],
  ["seed", "task seed", (s) => fmt(s.seed)],
  ["family", "family", (s) => s.family || "–"],
  ["episodes", "group", (s) => groupDots(s)],
  ["success_rate", "success", (s) => fmt(s.success_rate, 2), "num"],
  ["mean_reward", "reward", (s) => fmt(s.mean_reward, 3), "num"],
  ["mean_turns", "turns", (s) => fmt(s.mean_turns, 1), "num"],
  ["action_tokens", "tokens", (s) => fmt(s.action_tokens), "num"],
  ["branch_points", "branch pts", (s) => fmt(s.branch_points), "num"],
  ["reasons", "failures and truncations", (s) => reasonChips(s.reasons)],
];

function groupDots(s) {
  const ok = s.successes, fail = s.failed, bad = s.episodes - ok - fail;
  const span = el("span", { class: "dots", title: `${ok} succeeded, ${bad} did not, ${fail} failed` });
  const cap = 16;
  const add = (n, cls, ch) => { for (let k = 0; k < Math.min(n, cap); k++) span.append(el("span", { class: cls, text: ch })); };
  add(ok, "dot-ok", "●"); add(bad, "dot-bad", "○"); add(fail, "dot-fail", "✕");
  span.append(el("span", { class: "muted small", text: " " + s.episodes }));
  return span;
}

function reasonChips(reasons) {
  const out = el("span");
  for (const [r, n] of Object.entries(reasons || {})) {
    out.append(el("span", { class: "reason" + (r.startsWith("failed") ? " failed" : ""), text: `${r} ×${n}` }));
  }
  return out;
}

function filtered() {
  const f = S.filter, text = f.text.toLowerCase();
  let rows = S.run.trees.filter((s) => {
    if (f.step !== "" && String(s.step) !== f.step) return false;
    if (f.family !== "" && s.family !== f.family) return false;
    if (f.outcome === "all" && s.successes !== s.episodes) return false;
    if (f.outcome === "some" && !(s.successes > 0)) return false;
    if (f.outcome === "none" && s.successes !== 0) return false;
    if (f.outcome === "failed" && s.failed === 0) return false;
    if (f.outcome === "truncated" && s.truncated === 0) return false;
    if (f.outcome === "branched" && s.branch_points === 0) return false;
    if (text) {
      const hay = [s.seed, s.env, s.family, s.instruction, s.file, Object.keys(s.reasons || {}).join(" ")].join(" ").toLowerCase();
      if (!hay.includes(text)) return false;
    }
    return true;
  });
  const k = S.sort.key, dir = S.sort.asc ? 1 : -1;
  const val = (s) => k === "reasons" ? Object.values(s.reasons || {}).reduce((a, b) => a + b, 0) : s[k];
  rows = rows.slice().sort((x, y) => {
    const a = val(x), b = val(y);
    if (a === b) return x.index - y.index;
    if (a === null || a === undefined) return 1;
    if (b === null || b === undefined) return -1;
    return (a < b ? -1 : 1) * dir;
  });
  return rows;
}

function renderTable() {
  const rows = filtered();
  const pages = Math.max(1, Math.ceil(rows.length / PAGE_ROWS));
  S.page = Math.min(S.page, pages - 1);
  const cols = COLUMNS.filter(([key]) => key !== "family" || S.run.trees.some((s) => s.family));
  const head = el("tr", {}, cols.map(([key, label, , cls]) => el("th", {
    class: [cls, S.sort.key === key ? "sorted" : "", S.sort.key === key && S.sort.asc ? "asc" : ""].join(" ").trim(),
    "data-key": key, text: label,
    onclick: () => { S.sort = { key, asc: S.sort.key === key ? !S.sort.asc : key === "index" || key === "step" }; renderTable(); },
  })));
  const body = el("tbody");
  for (const s of rows.slice(S.page * PAGE_ROWS, (S.page + 1) * PAGE_ROWS)) {
    body.append(el("tr", { class: "tree-row", "data-tree": s.index, title: s.instruction || "", onclick: () => openTree(s.index) },
      cols.map(([, , f, cls]) => el("td", { class: cls }, f(s)))));
  }
  $("run-table").replaceChildren(el("thead", {}, head), body);
  if (!S.run.trees.length) {
    body.append(el("tr", {}, el("td", { colspan: cols.length, class: "empty",
      text: S.run.waiting
        ? "Waiting for the first step: the run has written no trees and no metrics yet. This page asks again every few seconds and fills in as they come."
        : "This run holds no trees: only its curves. agentrl rollout writes trajectories.jsonl; a training run holds trees/step-*.jsonl where the trainer saves them." })));
  }
  $("pager-info").textContent = rows.length
    ? `trees ${S.page * PAGE_ROWS + 1}–${Math.min(rows.length, (S.page + 1) * PAGE_ROWS)} of ${rows.length}` +
      (rows.length !== S.run.trees.length ? ` (filtered from ${S.run.trees.length})` : "")
    : "no tree matches";
  $("prev-page").disabled = S.page === 0;
  $("next-page").disabled = S.page >= pages - 1;
}

function renderAbout() {
  const r = S.run, info = [];
  for (const [k, v] of Object.entries(r.about || {})) if (v !== null && v !== "" && v !== undefined) info.push(`${k}: ${v}`);
  $("run-about").textContent = info.join(" · ");
  const skips = r.skipped_count || (r.skipped || []).length;
  if (skips) $("run-about").textContent += ` · skipped ${skips} unreadable line${skips > 1 ? "s" : ""}: ${r.skipped.join(", ")}` +
    (skips > r.skipped.length ? ` and ${skips - r.skipped.length} more` : "");
}

function renderRunHeader() {
  const r = S.run, t = r.totals;
  const cards = [["trees", t.trees], ["episodes", t.episodes], ["success", fmt(t.success_rate, 3)],
    ["mean reward", fmt(t.mean_reward, 3)], ["failed", t.failed], ["truncated", t.truncated]];
  $("run-cards").replaceChildren(...cards.map(([k, v]) => el("div", { class: "card" }, el("b", { text: String(v) }), el("span", { text: k }))));
  renderAbout();
  const stepSel = $("f-step");
  stepSel.replaceChildren(el("option", { value: "", text: "all steps" }),
    ...r.steps.filter((s) => s !== null).map((s) => el("option", { value: String(s), text: "step " + s })));
  const fams = [...new Set(r.trees.map((s) => s.family).filter(Boolean))].sort();
  $("f-family").replaceChildren(el("option", { value: "", text: "all families" }), ...fams.map((f) => el("option", { value: f, text: f })));
  $("f-family").hidden = fams.length === 0;
  $("f-step").hidden = r.steps.filter((s) => s !== null).length === 0;
}

// --------------------------------------------------------------------------- the tree

async function openTree(i, nodeId = null, leafId = null, view = "tree") {
  show(view);
  $("tree-title").textContent = `loading tree ${i}…`;
  let t;
  try { t = prepare(await loadTree(i)); } catch (e) { $("tree-title").textContent = String(e); return; }
  S.tree = t; S.treeIndex = i;
  S.node = nodeId !== null && (t._pos.has(nodeId) || nodeId === "prompt") ? nodeId : (t.roots.length ? t.roots[0] : null);
  S.leaf = leafId;
  for (const b of document.querySelectorAll("nav button[data-needs-tree]")) b.disabled = false;
  renderTree();
  if (view === "tokens") renderTokens(); else setHash();
  if (t.tokens_pending) awaitTokens(i);
}

// A tree served while the tokenizer was still loading holds token ids only
// (tokens_pending): ask for it again until it comes with the texts, then draw it
// again where the user is (same node, same view), and update the run's tokens note.
async function awaitTokens(i) {
  if (S.awaiting === i) return;
  S.awaiting = i;
  try {
    while (S.treeIndex === i && S.tree.tokens_pending) {
      await new Promise((ok) => setTimeout(ok, PENDING_RETRY_MS));
      if (S.treeIndex !== i) return;
      let t;
      try { t = await loadTree(i); } catch (e) {  // the run changed on disk (409): say so, stop asking
        if (S.treeIndex === i) $("tree-title").textContent = String(e);
        return;
      }
      if (S.treeIndex !== i || t.tokens_pending) continue;
      S.tree = prepare(t);
      S.run.about.tokens = t.tokens_note;
      renderAbout();
      if (S.view === "tokens") renderTokens(); else if (S.view === "tree") renderTree();
    }
  } finally { if (S.awaiting === i) S.awaiting = null; }
}

function treeTitle(t, i) {
  const m = t.meta || {}, s = S.run.trees[i] || {};
  return `tree ${i}` + (s.step !== null && s.step !== undefined ? ` · step ${s.step}` : "") +
    ` · task seed ${fmt(m.seed)} · ${m.env || ""} · ${m.allocator || "allocator ?"} · ` +
    `${t.episodes.length} episodes, ${t.nodes.length} nodes`;
}

function layout(t) {
  // Left to right: depth -> x, leaves -> consecutive rows, a parent centred on its children.
  // Depth first with a stack of its own, not recursion: an episode may be thousands of turns.
  const pos = new Map(); let row = 0; let maxDepth = 0;
  const todo = t.roots.map((r) => [r, 1, false]).reverse();
  while (todo.length) {
    const [id, depth, childrenPlaced] = todo.pop();
    const n = nodeOf(t, id);
    maxDepth = Math.max(maxDepth, depth);
    if (!n.children.length) { pos.set(id, { x: depth, y: row++ }); continue; }
    if (!childrenPlaced) {
      todo.push([id, depth, true], ...n.children.map((c) => [c, depth + 1, false]).reverse());
      continue;
    }
    const [lo, hi] = extent(n.children.map((c) => pos.get(c).y));
    pos.set(id, { x: depth, y: (lo + hi) / 2 });
  }
  const [lo, hi] = extent(t.roots.map((r) => pos.get(r).y));
  pos.set("prompt", { x: 0, y: t.roots.length ? (lo + hi) / 2 : 0 });
  return { pos, rows: Math.max(row, 1), depth: maxDepth };
}

function drawTree(t, container, opts = {}) {
  const dx = opts.dx || 190, dy = opts.dy || 40, pad = 26, label = opts.label ?? 26;
  const L = layout(t);
  const W = pad * 2 + L.depth * dx + 220, H = pad * 2 + (L.rows - 1) * dy + 20;
  const X = (p) => pad + 8 + p.x * dx, Y = (p) => pad + p.y * dy;
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "rollout tree" });
  const edges = svg("g"), nodes = svg("g");
  const edge = (a, b, cls = "") => {
    const x1 = X(a), y1 = Y(a), x2 = X(b), y2 = Y(b), mx = (x1 + x2) / 2;
    edges.append(svg("path", { class: "edge " + cls, d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}` }));
  };
  const ending = (id) => { const c = nodeOf(t, id); return c.error ? "bad" : c.truncated && c.leaf ? "warn" : ""; };
  for (const r of t.roots) edge(L.pos.get("prompt"), L.pos.get(r), ending(r));
  for (const n of t.nodes) for (const c of n.children) edge(L.pos.get(n.id), L.pos.get(c), ending(c));
  // the prompt: the task's opening state; its branch reason when several episodes start there
  const pp = L.pos.get("prompt");
  const promptG = svg("g", { class: "node prompt" + (t.branch_points.prompt ? " branch" : ""), "data-node": "prompt",
    transform: `translate(${X(pp)},${Y(pp)})` },
  svg("circle", { r: 6 }), svg("title", { text: "the prompt" + (t.branch_points.prompt ? ": " + t.branch_points.prompt : "") }));
  if (opts.selectable && S.node === "prompt") promptG.classList.add("selected");
  if (opts.onclick) promptG.addEventListener("click", () => opts.onclick("prompt"));
  nodes.append(promptG);
  for (const n of t.nodes) {
    const p = L.pos.get(n.id);
    if (!p) continue;
    const cls = ["node"];
    if (n.leaf) cls.push(n.success ? "leaf-ok" : "leaf-bad");
    if (n.truncated) cls.push("truncated");
    if (n.error) cls.push("failed");
    if (n.children.length > 1) cls.push("branch");
    if (n.partial) cls.push("partial");
    if (opts.selectable && S.node === n.id) cls.push("selected");
    const g = svg("g", { class: cls.join(" "), "data-node": n.id, transform: `translate(${X(p)},${Y(p)})` });
    g.append(svg("circle", { r: 7 }));
    const marks = [];
    if (n.error) marks.push(["✕", "bad"]);
    else if (n.truncated) marks.push(["⋯", "warn"]);
    if (n.children.length > 1) marks.push([`×${n.children.length}`, "branch"]);
    if (marks.length) g.append(svg("text", { class: "mark", x: -9, y: -9, "text-anchor": "end" },
      ...marks.map(([m, c]) => svg("tspan", { class: c, text: m + " " }))));
    if (label) {
      g.append(svg("text", { x: 11, y: -3, text: (n.partial ? "…" : "") + short(n.action, label) }));
      const adv = n.advantage !== null && n.advantage !== undefined ? ` A=${sfmt(n.advantage, 2)}` : "";
      const why = n.error ? " · failed: " + short(n.error, label) : n.truncated && n.leaf
        ? " · " + short(n.truncation_reason || (n.finish_reason === "length" ? "length" : "env limit"), label) : "";
      g.append(svg("text", { class: "sub", x: 11, y: 11, text: `#${n.id} r=${fmt(n.reward, 2)}${adv}${why}` }));
    }
    const tip = [`node ${n.id}: ${short(n.action, 80)}`, `reward ${fmt(n.reward)}`];
    if (n.advantage !== null) tip.push(`advantage ${sfmt(n.advantage)}`);
    if (n.branch) tip.push(`branch point: ${n.branch}`);
    if (n.error) tip.push(`failed: ${n.error}`);
    else if (n.truncated) tip.push(`truncated: ${n.truncation_reason || n.finish_reason || "?"}`);
    g.append(svg("title", { text: tip.join("\n") }));
    if (opts.onclick) g.addEventListener("click", () => opts.onclick(n.id));
    nodes.append(g);
  }
  root.append(edges, nodes);
  container.replaceChildren(root);
}

function renderTree() {
  const t = S.tree;
  $("tree-title").textContent = treeTitle(t, S.treeIndex);
  $("tree-credit").textContent = `advantages: ${t.credit.method} — ${t.credit.note}`;
  const inst = (t.meta || {}).instruction;
  $("tree-instruction").textContent = inst ? "task: " + inst : "";
  drawTree(t, $("tree-canvas"), { selectable: true, onclick: (id) => { S.node = id; S.leaf = null; renderTree(); } });
  renderNodeDetail();
  setHash();
}

function leavesThrough(t, id) {
  return t.episodes.filter((e) => e.path.includes(id));
}

function currentLeaf(t, id) {
  const eps = leavesThrough(t, id);
  if (!eps.length) return null;
  return eps.some((e) => e.leaf === S.leaf) ? S.leaf : eps[0].leaf;
}

function kv(pairs) {
  const dl = el("dl", { class: "kv" });
  for (const [k, v, cls] of pairs) dl.append(el("dt", { text: k }), el("dd", { class: cls || null }, v));
  return dl;
}

function renderNodeDetail() {
  const t = S.tree, box = $("node-detail");
  if (S.node === null) { box.replaceChildren(el("p", { class: "muted", text: "Click a node." })); return; }
  if (S.node === "prompt") { renderPromptDetail(t, box); return; }
  const n = nodeOf(t, S.node);
  const badges = [];
  if (n.children.length > 1) badges.push(el("span", { class: "badge branch", text: `branch point ×${n.children.length}` }));
  if (n.partial) badges.push(el("span", { class: "badge plain", text: "segment fork (partial turn)" }));
  if (n.error) badges.push(el("span", { class: "badge bad", text: "failed" }));
  else if (n.truncated) badges.push(el("span", { class: "badge warn", text: "truncated" }));
  if (n.terminated) badges.push(el("span", { class: "badge plain", text: "terminated" }));
  if (n.leaf && !n.error) badges.push(el("span", { class: "badge " + (n.success ? "ok" : "bad"), text: n.success ? "success" : "no success" }));
  if (n.abandoned) badges.push(el("span", { class: "badge plain", text: "abandoned by the harness" }));
  if (n.continued_by) badges.push(el("span", { class: "badge plain", text: `continued by ${n.continued_by} (compacted or re-rendered): gets the session's reward` }));
  if (n.side_conversation) badges.push(el("span", { class: "badge plain", text: "side conversation of the session: gets its reward" }));
  const parts = [el("h3", { text: `node ${n.id} · turn ${n.depth + 1} · policy v${n.version}` }), el("div", {}, badges)];
  if (n.branch) parts.push(el("h4", { text: "branch point" }), el("div", { class: "branch-reason", text: n.branch }));
  if (n.error) parts.push(el("h4", { text: "failure" }), el("pre", { class: "failure", text: n.error }));
  else if (n.truncated) parts.push(el("h4", { text: "truncated" }), el("div", { class: "truncation", text: n.truncation_reason || (n.finish_reason === "length" ? "finish_reason=length (max_new_tokens)" : "the env truncated the episode (its own limit, e.g. max_turns)") }));
  parts.push(el("h4", { text: n.partial ? "action (first tokens)" : "action" }), el("pre", { class: "action-text", text: n.action || "(empty)" }));
  if (n.tool_calls.length) {
    parts.push(el("h4", { text: "tool calls" }));
    for (const c of n.tool_calls) parts.push(el("pre", { class: "tool-call", text: `${c.name}(${JSON.stringify(c.arguments)})` }));
  }
  if (n.tool_results.length) {
    parts.push(el("h4", { text: "tool results" }));
    for (const r of n.tool_results) parts.push(el("pre", { class: "tool-result", text: (r.name ? r.name + ": " : "") + r.content }));
  }
  if (n.parse_errors.length) parts.push(el("h4", { text: "tool-call parse errors" }), el("pre", { text: n.parse_errors.join("\n") }));
  if (!n.partial) parts.push(el("h4", { text: "observation" }), el("pre", { class: "observation", text: n.observation || "(none)" }));
  const advs = Object.entries(n.advantages || {});
  const left = leavesThrough(t, n.id).filter((e) => e.trained === false);
  const leftText = left.map((e) => `leaf ${e.leaf} left out of the update: ${e.untrained_reason}`).join("; ");
  const advText = n.advantage === null || n.advantage === undefined
    ? "– (" + (left.length ? leftText : n.error ? "failed episode: left out of training" : t.credit.note) + ")"
    : sfmt(n.advantage, 4) + (advs.length > 1 ? `  (mean of ${advs.length} episodes: ${advs.map(([l, a]) => `leaf ${l} ${sfmt(a, 3)}`).join(", ")})` : "")
      + (left.length ? `; ${leftText}` : "");
  parts.push(el("h4", { text: "numbers" }), kv([
    ["reward", fmt(n.reward, 4)], ["advantage", el("span", { class: "advantage", text: advText })],
    ["action tokens", String(n.n_action)], ["context tokens", String(n.n_context)],
    ["finish reason", n.finish_reason || "–"],
    ...(n.expert_action ? [["expert action", n.expert_action]] : []),
  ]));
  const info = Object.entries(n.info || {});
  if (info.length) parts.push(el("h4", { text: "env info" }), kv(info.map(([k, v]) => [k, typeof v === "object" ? JSON.stringify(v) : String(v)])));
  const eps = leavesThrough(t, n.id);
  if (eps.length) {
    const leaf = currentLeaf(t, n.id);
    const sel = el("select", { id: "leaf-select", onchange: (e) => { S.leaf = Number(e.target.value); setHash(); } },
      eps.map((e) => el("option", { value: e.leaf, selected: e.leaf === leaf, text: `leaf ${e.leaf}: ${e.error ? "failed" : e.success ? "success" : "no success"}, reward ${fmt(e.reward, 2)}, ${e.turns} turns${e.trained === false ? ", not trained" : ""}` })));
    parts.push(el("h4", { text: `episodes through this node (${eps.length})` }), sel);
  }
  parts.push(el("div", { class: "row", style: "margin-top:10px" },
    el("button", { id: "show-tokens", onclick: () => { show("tokens"); renderTokens(); } }, "Token view of this turn ▸")));
  box.replaceChildren(...parts);
}

function renderPromptDetail(t, box) {
  const m = t.meta || {};
  const parts = [el("h3", { text: "the prompt (the task's opening state)" })];
  if (t.branch_points.prompt) parts.push(el("h4", { text: "branch point" }), el("div", { class: "branch-reason", text: t.branch_points.prompt }));
  if (m.instruction) parts.push(el("h4", { text: "instruction" }), el("pre", { text: m.instruction }));
  if (m.privileged) parts.push(el("h4", { text: "privileged text (teacher only, never in a prompt)" }), el("pre", { text: m.privileged }));
  const rows = [["env", m.env], ["task seed", m.seed], ["task", m.task], ["allocator", m.allocator],
    ["budget", m.budget ? `${m.budget.spent} of ${m.budget.total} ${m.budget.unit} (the batch's)` : null]]
    .filter(([, v]) => v !== null && v !== undefined).map(([k, v]) => [k, String(v)]);
  for (const [k, v] of Object.entries(m.counters || {})) rows.push([k, String(v)]);
  parts.push(el("h4", { text: "task" }), kv(rows));
  box.replaceChildren(...parts);
}

// --------------------------------------------------------------------------- the token view

const MODES = [
  ["mask", "loss mask"], ["logprob", "behaviour logprob"], ["entropy", "entropy"],
  ["advantage", "advantage"], ["ratio", "teacher − student log-ratio"],
];

function turnTokens(t, id, leaf) {
  // The whole turn: the context tokens before the action, then the action tokens of the
  // turn's nodes (a segment fork's partial nodes hold its first tokens).
  const n = nodeOf(t, id);
  const ids = n.partial ? [id] : n.turn;
  const toks = [];
  ids.forEach((nid, j) => {
    const tk = t.tokens[String(nid)];
    if (j === 0) tk.context.forEach((tok) => toks.push({ id: tok, ctx: true, node: nid }));
    const adv = (tk.advantages || {})[String(leaf)], tea = (tk.teacher || {})[String(leaf)], stu = (tk.student || {})[String(leaf)];
    tk.action.forEach((tok, k) => {
      const lp = tk.logprobs[k], teacher = tea ? tea[k] : null, student = stu ? stu[k] : lp;
      toks.push({ id: tok, ctx: false, node: nid, lp, ent: tk.entropies[k] ?? null, top1: tk.top1[k] ?? null,
        adv: adv ? adv[k] : null, dropped: Boolean(adv) && adv[k] === null, teacher, ratio: teacher !== null && teacher !== undefined && student !== null ? teacher - student : null });
    });
  });
  return toks;
}

function tokenScale(acts) {
  // the colour scales of a turn's action tokens: the largest entropy, |advantage|, |log-ratio|
  return {
    ent: extent(acts.map((x) => x.ent || 0), 1e-9, 1e-9)[1],
    adv: extent(acts.map((x) => Math.abs(x.adv || 0)), 0, 0)[1],
    ratio: extent(acts.map((x) => Math.abs(x.ratio || 0)), 0, 0)[1],
  };
}

function colour(mode, tok, scale) {
  if (mode === "mask") return tok.ctx ? "#eceff3" : tok.dropped ? "#fde2cf" : "#cfe3ff";
  if (tok.ctx) return "transparent";
  const div = (x, m) => { // diverging: red below 0, green above
    if (x === null || x === undefined || !m) return "#f3f4f6";
    const a = Math.min(1, Math.abs(x) / m);
    return x >= 0 ? `rgba(22,163,74,${0.12 + 0.6 * a})` : `rgba(220,38,38,${0.12 + 0.6 * a})`;
  };
  if (mode === "logprob") {
    if (tok.lp === null || tok.lp === undefined) return "#f3f4f6";
    const p = Math.exp(tok.lp); return `rgba(220,38,38,${0.05 + 0.75 * (1 - p)})`;
  }
  if (mode === "entropy") {
    if (tok.ent === null) return "#f3f4f6";
    return `rgba(124,58,237,${0.05 + 0.75 * Math.min(1, tok.ent / (scale.ent || 1))})`;
  }
  if (mode === "advantage") return div(tok.adv, scale.adv);
  if (mode === "ratio") return div(tok.ratio, scale.ratio);
  return "transparent";
}

function legend(mode, scale, t) {
  const bar = (css) => el("span", { class: "bar", style: "background:" + css });
  if (mode === "mask") return el("span", { class: "legend" }, el("span", { class: "tok", style: "background:#cfe3ff;padding:0 6px", text: "action (trained)" }),
    scale.dropped ? el("span", { style: "background:#fde2cf;padding:0 6px", text: "action, left out of the update" }) : null,
    el("span", { style: "background:#eceff3;padding:0 6px", text: "context (masked)" }));
  if (mode === "logprob") return el("span", { class: "legend" }, "p = 1", bar("linear-gradient(90deg, rgba(220,38,38,.05), rgba(220,38,38,.8))"), "p → 0");
  if (mode === "entropy") return el("span", { class: "legend" }, "0", bar("linear-gradient(90deg, rgba(124,58,237,.05), rgba(124,58,237,.8))"), `${fmt(scale.ent, 2)} nats`);
  const m = mode === "advantage" ? scale.adv : scale.ratio;
  if (!m) return el("span", { class: "legend muted", text: mode === "ratio" ? "teacher log-probs: " + t.teacher_note : "no advantages for this episode" });
  return el("span", { class: "legend" }, sfmt(-m, 2), bar("linear-gradient(90deg, rgba(220,38,38,.72), #f3f4f6, rgba(22,163,74,.72))"), sfmt(m, 2));
}

function tokenText(t, id) {
  const s = t.vocab[String(id)];
  return s === undefined ? `⟨${id}⟩` : s;
}

function renderTokens() {
  const t = S.tree;
  if (!t || S.node === null || S.node === "prompt") {
    $("token-head").textContent = "Open a tree and pick a turn's node first.";
    $("token-view").replaceChildren(); $("token-modes").replaceChildren(); $("token-legend").replaceChildren();
    return;
  }
  const n = nodeOf(t, S.node);
  const leaf = currentLeaf(t, n.id);
  const toks = turnTokens(t, n.id, leaf);
  const ep = t.episodes.find((e) => e.leaf === leaf);
  // an episode the update left out trained none of its tokens; a null saved value, that token
  if (ep && ep.trained === false) for (const tok of toks) if (!tok.ctx) tok.dropped = true;
  const acts = toks.filter((x) => !x.ctx);
  const scale = { ...tokenScale(acts), dropped: acts.some((x) => x.dropped) };
  put($("token-head"), el("b", { text: `tree ${S.treeIndex} · node ${n.id} · turn ${n.depth + 1}` }),
    el("span", { class: "muted", text: ` · episode ending at leaf ${leaf ?? "–"} · ${acts.length} action tokens, ${toks.length - acts.length} context tokens` }),
    el("div", { class: "small muted", text: `mean logprob ${fmt(mean(acts.map((x) => x.lp)), 3)} · mean entropy ${fmt(mean(acts.map((x) => x.ent)), 3)} · advantages: ${t.credit.note}`
      + (t.has_teacher ? ` · teacher − student log-ratio: ${t.teacher_note}` : "") }),
    ep && ep.trained === false ? el("div", { class: "small", text: `this episode was left out of the update: ${ep.untrained_reason}` }) : null,
    Object.keys(t.vocab).length ? null : el("div", { class: "small muted", text: t.tokens_pending
      ? "loading the tokenizer: token ids until it is ready, then the texts" : "token texts unavailable (no tokenizer for this run): ids shown" }));
  const modes = $("token-modes");
  modes.replaceChildren(...MODES.map(([m, label]) => el("label", {},
    el("input", { type: "radio", name: "tokmode", value: m, checked: S.tokenMode === m, disabled: m === "ratio" && !t.has_teacher,
      onchange: () => { S.tokenMode = m; renderTokens(); } }), " " + label + (m === "ratio" && !t.has_teacher ? (t.teacher_note.startsWith("none") ? " (no teacher)" : " (not saved)") : ""))),
  el("label", {}, el("input", { type: "checkbox", checked: S.showContext, onchange: (e) => { S.showContext = e.target.checked; renderTokens(); } }), " context tokens"));
  $("token-legend").replaceChildren(legend(S.tokenMode, scale, t));
  const view = $("token-view");
  const frag = document.createDocumentFragment();
  let prevCtx = null;
  toks.forEach((tok, k) => {
    if (tok.ctx && !S.showContext) return;
    if (prevCtx === true && !tok.ctx) frag.append(el("span", { class: "sep" }));
    prevCtx = tok.ctx;
    const span = el("span", { class: "tok" + (tok.ctx ? " ctx" : " act"), "data-k": k, text: tokenText(t, tok.id) });
    span.style.background = colour(S.tokenMode, tok, scale);
    frag.append(span);
  });
  view.replaceChildren(frag);
  view.onmousemove = (e) => {
    const s = e.target.closest ? e.target.closest(".tok") : null;
    const tip = $("tok-tip");
    if (!s) { tip.hidden = true; return; }
    const tok = toks[Number(s.dataset.k)];
    const rows = [["token", JSON.stringify(tokenText(t, tok.id))], ["id", tok.id], ["node", tok.node], ["loss mask", tok.ctx ? "0 (context)" : tok.dropped ? "0 (an action token, left out of the update)" : "1 (action)"]];
    if (!tok.ctx) {
      rows.push(["logprob", fmt(tok.lp, 4)], ["p", tok.lp === null || tok.lp === undefined ? "–" : fmt(Math.exp(tok.lp), 4)],
        ["entropy", fmt(tok.ent, 4)], ["advantage", tok.adv === null || tok.adv === undefined ? (tok.dropped ? "– (masked out of the update)" : "–") : sfmt(tok.adv, 4)]);
      if (tok.top1 !== null) rows.push(["top-1 p", fmt(tok.top1, 4)]);
      if (tok.teacher !== null && tok.teacher !== undefined) rows.push(["teacher logprob", fmt(tok.teacher, 4)], ["log-ratio t − s", sfmt(tok.ratio, 4)]);
    }
    tip.replaceChildren(el("table", {}, rows.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: String(v) })))));
    tip.hidden = false;
    tip.style.left = Math.min(e.clientX + 14, window.innerWidth - 300) + "px";
    tip.style.top = (e.clientY + 16) + "px";
  };
  view.onmouseleave = () => { $("tok-tip").hidden = true; };
  setHash();
}

// --------------------------------------------------------------------------- curves

const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563"];

function renderCurves() {
  const box = $("curves");
  const panels = S.run.curves || [];
  if (!panels.length) { box.replaceChildren(el("div", { class: "empty", text: "No metrics.jsonl in this run (agentrl train writes one)." })); return; }
  box.replaceChildren(...panels.map((p) => el("div", { class: "panel", "data-panel": p.title }, el("h3", { text: p.title }), chart(p))));
}

function chart(p) {
  const series = p.series.filter((s) => s.points.length);
  if (!series.length) return el("div", { class: "muted small", text: p.missing || "not logged by this run" });
  const W = 380, H = 190, l = 48, r = 10, top = 8, b = 26;
  const xs = series.flatMap((s) => s.points.map((q) => q[0])), ys = series.flatMap((s) => s.points.map((q) => q[1]));
  let [x0, x1] = extent(xs), [y0, y1] = extent(ys);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const X = (x) => l + (x - x0) / (x1 - x0) * (W - l - r), Y = (y) => top + (1 - (y - y0) / (y1 - y0)) * (H - top - b);
  const g = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  for (let k = 0; k <= 4; k++) {
    const y = y0 + (y1 - y0) * k / 4;
    g.append(svg("line", { class: "gridline", x1: l, x2: W - r, y1: Y(y), y2: Y(y) }),
      svg("text", { x: l - 4, y: Y(y) + 3, "text-anchor": "end", text: compact(y) || fmt(y, Math.abs(y1 - y0) < 0.1 ? 4 : 2) }));
  }
  const span = x1 - x0, stepX = span <= 8 ? 1 : Math.ceil(span / 6);
  for (let x = Math.ceil(x0); x <= x1; x += stepX) {
    g.append(svg("text", { x: X(x), y: H - 8, "text-anchor": "middle", text: String(x) }));
  }
  g.append(svg("line", { class: "axis", x1: l, x2: l, y1: top, y2: H - b }), svg("line", { class: "axis", x1: l, x2: W - r, y1: H - b, y2: H - b }));
  series.forEach((s, k) => {
    const c = COLOURS[k % COLOURS.length];
    if (!s.eval && s.points.length > 1) g.append(svg("path", { class: "series", stroke: c, d: s.points.map((q, j) => (j ? "L" : "M") + X(q[0]) + "," + Y(q[1])).join(" ") }));
    for (const q of s.points) {
      g.append(svg("circle", { cx: X(q[0]), cy: Y(q[1]), r: s.eval ? 4 : 2.2, fill: s.eval ? "#fff" : c, stroke: c, "stroke-width": 1.5 },
        svg("title", { text: `${s.key} at step ${q[0]}: ${fmt(q[1], 4)}` })));
    }
  });
  const keys = el("div", { class: "keys" }, series.map((s, k) => el("span", { style: "color:" + COLOURS[k % COLOURS.length] },
    (s.eval ? "○ " : "— ") + s.key + (s.eval ? " (held-out)" : ""))));
  const wrap = el("div");
  wrap.append(g, keys);
  return wrap;
}

// --------------------------------------------------------------------------- compare

function taskKey(s) { return `${s.env}|${s.seed}`; }

async function openCompare(a = null, b = null) {
  show("compare");
  const trees = S.run.trees;
  const byTask = new Map();
  for (const s of trees) { const k = taskKey(s); if (!byTask.has(k)) byTask.set(k, []); byTask.get(k).push(s); }
  const repeated = [...byTask.values()].filter((v) => new Set(v.map((s) => s.step)).size > 1);
  const held = (i) => Number.isInteger(i) && i >= 0 && i < trees.length;
  if (!held(a) || !held(b)) a = null;  // a link from a bigger run, or none: the default pair
  if (a === null) {
    const g = repeated[0] || (trees.length > 1 ? trees.slice(0, 2) : null);
    if (!g) { $("compare-body").replaceChildren(el("div", { class: "empty", text: "This run holds fewer than two trees." })); return; }
    a = g[0].index; b = g[g.length - 1].index;
  }
  S.compare = { a, b };
  const task = byTask.get(taskKey(trees[a])) || [];
  const optionText = (s) => `tree ${s.index}` + (s.step !== null ? ` · step ${s.step}` : "") + ` · seed ${fmt(s.seed)} · success ${fmt(s.success_rate, 2)}`;
  const taskSel = el("select", { id: "compare-task", onchange: (e) => { const v = byTask.get(e.target.value); openCompare(v[0].index, v[v.length - 1].index); } },
    [...byTask.entries()].map(([k, v]) => el("option", { value: k, selected: k === taskKey(trees[a]), text: `seed ${fmt(v[0].seed)} (${v[0].env}) · ${v.length} tree${v.length > 1 ? "s" : ""}` })));
  const pick = (which, cur) => el("select", { id: "compare-" + which, onchange: (e) => { const v = Number(e.target.value); openCompare(which === "a" ? v : S.compare.a, which === "b" ? v : S.compare.b); } },
    (task.length > 1 ? task : trees).map((s) => el("option", { value: s.index, selected: s.index === cur, text: optionText(s) })));
  put($("compare-controls"), el("span", { text: "task " }), taskSel, el("span", { text: " before " }), pick("a", a), el("span", { text: " after " }), pick("b", b),
    repeated.length ? null : el("span", { class: "muted small", text: " no task appears in two steps of this run: any two trees can be compared" }));
  setHash();
  let ta, tb;
  try { [ta, tb] = [prepare(await loadTree(a)), prepare(await loadTree(b))]; } catch (e) { $("compare-body").textContent = String(e); return; }
  const sa = stats(ta), sb = stats(tb);
  const col = (t, s, i, other) => {
    const mini = el("div", { class: "mini" });
    drawTree(t, mini, { dx: 140, dy: 36, label: 14, onclick: (id) => openTree(i, id) });
    const rows = STAT_ROWS.map(([k, label, d]) => {
      const delta = other ? statDelta(s[k], other[k]) : null;
      return [label, el("span", {}, fmt(s[k], d), delta !== null && Number.isFinite(delta) && Math.abs(delta) >= 0.5 * 10 ** -d
        ? el("span", { class: delta > 0 ? "delta-pos" : "delta-neg", text: `  (${sfmt(delta, d)})` }) : null)];
    });
    return el("div", { class: "col", "data-tree": i },
      el("h3", {}, el("a", { href: "#tree=" + i, onclick: (e) => { e.preventDefault(); openTree(i); }, text: treeTitle(t, i) })),
      kv(rows), mini,
      el("ol", { class: "episodes" }, t.episodes.map((e) => el("li", {},
        el("span", { class: e.error ? "dot-fail" : e.success ? "dot-ok" : "dot-bad", text: e.error ? "✕ " : e.success ? "● " : "○ " }),
        `r=${fmt(e.reward, 2)} · ${e.turns} turns: `, el("span", { class: "small", text: e.actions.map((x) => short(x, 28)).join(" → ") }),
        e.reason ? el("span", { class: "reason" + (e.error ? " failed" : ""), text: e.reason }) : null))));
  };
  $("compare-body").replaceChildren(el("div", { class: "compare" }, col(ta, sa, a, null), col(tb, sb, b, sa)));
}

const STAT_ROWS = [["success", "success rate", 3], ["reward", "mean reward", 3], ["turns", "mean turns", 2],
  ["tokens", "action tokens / episode", 1], ["logprob", "mean action logprob", 3], ["entropy", "mean action entropy", 3],
  ["branches", "branch points", 0]];

function statDelta(a, b) {
  // after - before where both sides have a number: null - 0.5 is -0.5 in JavaScript, and a tree
  // whose every episode failed has no success rate
  const num = (x) => typeof x === "number" && Number.isFinite(x);
  return num(a) && num(b) ? a - b : null;
}

function stats(t) {
  const ok = t.episodes.filter((e) => !e.error);
  const lps = [], ents = [];
  for (const tk of Object.values(t.tokens)) { for (const x of tk.logprobs) lps.push(x); for (const x of tk.entropies) ents.push(x); }
  const tokens = t.episodes.map((e) => e.path.reduce((a, id) => a + nodeOf(t, id).n_action, 0));
  return {
    success: ok.length ? ok.filter((e) => e.success).length / ok.length : null,
    reward: mean(ok.map((e) => e.reward)), turns: mean(t.episodes.map((e) => e.turns)), tokens: mean(tokens),
    logprob: mean(lps), entropy: mean(ents),
    branches: t.nodes.filter((n) => n.children.length > 1).length + (t.roots.length > 1 ? 1 : 0),
  };
}

// --------------------------------------------------------------------------- start

// A run served before its first step (the server says "waiting"): ask for the index
// again until it holds trees, and draw it again each time it changed (metrics may come
// first). A tree is not open meanwhile: there is none to open.
async function awaitFirstStep() {
  while (!S.run.trees.length) {
    await new Promise((ok) => setTimeout(ok, FIRST_STEP_POLL_MS));
    let next;
    try { next = await loadRun(); } catch (e) { $("run-about").textContent = "could not load the run: " + e; return; }
    if (next.generation === S.run.generation) continue;
    S.run = next;
    document.title = "agentrl · " + S.run.title;
    $("title").textContent = S.run.title;
    renderRunHeader();
    renderTable();
    renderCurves();
  }
}

async function main() {
  try { S.run = await loadRun(); } catch (e) { document.body.append(el("pre", { text: "could not load the run: " + e })); return; }
  document.title = "agentrl · " + S.run.title;
  $("title").textContent = S.run.title;
  renderRunHeader();
  renderTable();
  renderCurves();
  for (const b of document.querySelectorAll("nav button")) {
    b.addEventListener("click", () => {
      const v = b.dataset.view;
      if (v === "compare") openCompare(S.compare.a, S.compare.b);
      else if (v === "tokens") { show("tokens"); renderTokens(); }
      else { show(v); setHash(); }
    });
  }
  $("f-text").addEventListener("input", (e) => { S.filter.text = e.target.value; S.page = 0; renderTable(); });
  for (const [id, key] of [["f-step", "step"], ["f-outcome", "outcome"], ["f-family", "family"]]) {
    $(id).addEventListener("change", (e) => { S.filter[key] = e.target.value; S.page = 0; renderTable(); });
  }
  $("prev-page").addEventListener("click", () => { S.page--; renderTable(); });
  $("next-page").addEventListener("click", () => { S.page++; renderTable(); });
  $("prev-tree").addEventListener("click", () => { if (S.treeIndex > 0) openTree(S.treeIndex - 1); });
  $("next-tree").addEventListener("click", () => { if (S.treeIndex < S.run.trees.length - 1) openTree(S.treeIndex + 1); });
  window.addEventListener("hashchange", route);  // a pasted or followed link to a tree or node
  await route();
  document.body.dataset.ready = "1";
  if (S.mode === "server" && S.run.waiting) awaitFirstStep();
}

main();
