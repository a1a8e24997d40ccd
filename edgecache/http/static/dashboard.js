// The operator's page: reads /stats and /stats/history with the key it was given and draws them, as SVG, with no
// library. Every figure shown straight from /stats carries its place in that JSON (data-figure, a JSON array path)
// and the value read there (data-value), so a test can hold the page to /stats.
"use strict";

const REFRESH_MS = 5000;          // /stats
const HISTORY_REFRESH_MS = 30000; // /stats/history (its points change once a minute)
const KEY_SLOT = "edgecache-dashboard-key";
const LAYERS = ["exact", "shared", "semantic", "kv_prefix"];
const LAYER_NAMES = {exact: "exact", shared: "shared (in flight)", semantic: "semantic", kv_prefix: "KV prefix"};
const COLORS = {exact: "#2b7bb9", shared: "#7e57c2", semantic: "#2e9e6b", kv_prefix: "#e39b28", spent: "#c0392b",
                all: "#1d2733", served: "#2e9e6b", refused: "#9aa5b1", busy: "#1f4e79"};
const PALETTE = ["#c0392b", "#e39b28", "#2b7bb9", "#7e57c2", "#2e9e6b", "#8d6e63", "#00897b", "#d81b60", "#546e7a",
                 "#f4511e", "#3949ab", "#7cb342"];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  key: null,          // the key, while the page has one (null: none given yet)
  view: "",           // "" the box (admin), else a tenant the admin chose
  tenantNames: [],    // the tenants the admin's view names
  stats: null, history: null,
  statsSeq: 0, historySeq: 0, statsFetches: 0, generation: 0,
  timer: null, historyTimer: null,
};

// ---- small DOM helpers (text is always set as text, never parsed as HTML) ----

function $(id) { return document.getElementById(id); }

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v; else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function s(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function swatch(color) {
  const box = h("span", {class: "swatch"});
  box.style.background = color;
  return box;
}

function legend(items) {
  return h("div", {class: "legend"}, items.map(([name, color]) => h("span", {}, swatch(color), name)));
}

// ---- reading /stats ----

function at(body, path) {
  let v = body;
  for (const part of path) {
    if (v === null || v === undefined) return undefined;
    v = v[part];
  }
  return v;
}

// A figure straight from /stats: its text, and where it came from.
function fig(path, format, body) {
  const value = at(body || state.stats, path);
  return h("span", {"data-figure": JSON.stringify(path), "data-value": JSON.stringify(value ?? null)},
           format(value ?? null));
}

// A figure the page works out from /stats' figures (a sum, a ratio).
function derived(name, value, format) {
  return h("span", {"data-derived": name, "data-value": JSON.stringify(value ?? null)}, format(value ?? null));
}

// ---- formats ----

function fmtInt(n) { return Math.round(n || 0).toLocaleString("en-US"); }

function fmtSeconds(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "—";
  const a = Math.abs(s);
  if (a === 0) return "0 s";
  if (a < 0.001) return (s * 1e6).toFixed(0) + " µs";
  if (a < 1) return (s * 1000).toFixed(a < 0.01 ? 2 : 0) + " ms";
  if (a < 60) return s.toFixed(a < 10 ? 2 : 1) + " s";
  if (a < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(2) + " h";
}

function fmtShare(x) { return x === null || x === undefined ? "—" : (x * 100).toFixed(1) + " %"; }
function fmtTimes(x) { return x === null || x === undefined ? "—" : x.toFixed(2) + "×"; }

function fmtMoney(v, currency) {
  if (v === null || v === undefined) return "—";
  const digits = Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 1 ? 2 : 4;
  return v.toFixed(digits) + " " + (currency || "");
}

function fmtBytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function fmtClock(unixS) {
  const d = new Date(unixS * 1000);
  return String(d.getHours()).padStart(2, "0") + ":" + String(d.getMinutes()).padStart(2, "0");
}

function sum(obj) { return Object.values(obj || {}).reduce((a, b) => a + b, 0); }

function hitRate(requests) {
  const r = requests || {};
  const served = sum(r) - (r.error || 0) - (r.rejected || 0);
  return served > 0 ? ((r.exact || 0) + (r.shared || 0) + (r.semantic || 0)) / served : null;
}

// ---- the key ----

function keyFromFragment() {
  const m = location.hash.match(/(?:^#|&)key=([^&]*)/);
  if (!m) return null;
  // The key leaves the address bar (and the tab's history) at once; it stays in this tab's session storage.
  history.replaceState(null, "", location.pathname + location.search);
  return decodeURIComponent(m[1]);
}

function showLogin(message) {
  stopRefresh();
  state.key = null; state.stats = null; state.history = null;
  sessionStorage.removeItem(KEY_SLOT);
  $("board").hidden = true;
  $("forget").hidden = true;
  $("who").textContent = "";
  $("status").textContent = "";
  $("login").hidden = false;
  const error = $("login-error");
  error.hidden = !message;
  error.textContent = message || "";
  clearBoard();
}

function clearBoard() {
  for (const id of ["tiles", "layers", "tenants", "chart-saved", "chart-hits", "chart-misses", "near-cut",
                    "engine-tiles", "chart-busy", "ttft", "prefix"]) {
    $(id).replaceChildren();
  }
}

function useKey(key) {
  state.key = key;
  sessionStorage.setItem(KEY_SLOT, key);
  $("login").hidden = true;
  refresh(true);
}

// ---- fetching ----

class Refused extends Error {}

async function getJSON(path) {
  const headers = state.key ? {Authorization: "Bearer " + state.key} : {};
  const resp = await fetch(path, {headers, cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer"});
  if (resp.status === 401 || resp.status === 403) {
    let why = "";
    try { why = (await resp.json()).error.message; } catch (e) { why = resp.statusText; }
    throw new Refused(why);
  }
  if (!resp.ok) throw new Error(path + ": HTTP " + resp.status);
  return resp.json();
}

function statsPath() { return state.view ? "/stats?tenant=" + encodeURIComponent(state.view) : "/stats"; }

function historyPath() {
  const [minutes, step] = $("window").value.split(":");
  let path = "/stats/history?minutes=" + minutes + "&step=" + step;
  if (state.view) path += "&tenant=" + encodeURIComponent(state.view);
  return path;
}

function stopRefresh() {
  clearTimeout(state.timer); clearTimeout(state.historyTimer);
  state.timer = state.historyTimer = null;
}

// Each refresh is numbered; one that a newer refresh (another view, another key) overtook draws nothing. The page
// marks which /stats request it drew (data-stats-fetch: its number among the page's /stats requests) and how many
// answers it has drawn (data-stats-seq).
async function refresh(withHistory) {
  if (state.key === null) return;
  clearTimeout(state.timer);
  const key = state.key, generation = ++state.generation, fetchNo = ++state.statsFetches;
  const current = () => generation === state.generation && state.key === key;
  try {
    const stats = await getJSON(statsPath());
    if (!current()) return;
    if (withHistory || state.history === null) await refreshHistory();
    if (!current()) return;
    state.stats = stats;
    render();
    state.statsSeq += 1;
    document.body.dataset.statsFetch = String(fetchNo);
    document.body.dataset.statsSeq = String(state.statsSeq);
    $("status").textContent = "updated " + new Date().toLocaleTimeString() + " · every " + REFRESH_MS / 1000 + " s";
  } catch (err) {
    if (!current()) return;
    if (err instanceof Refused) { showLogin("The key was refused: " + err.message); return; }
    $("status").textContent = "could not read the figures (" + err.message + "); trying again";
  }
  if (current() && !document.hidden) state.timer = setTimeout(() => refresh(false), REFRESH_MS);
}

async function refreshHistory() {
  clearTimeout(state.historyTimer);
  const key = state.key, view = state.view, path = historyPath();
  if (key === null) return;
  const current = () => state.key === key && state.view === view && path === historyPath();
  try {
    const history = await getJSON(path);
    if (!current()) return;
    state.history = history;
    state.historySeq += 1;
    document.body.dataset.historySeq = String(state.historySeq);
  } finally {
    if (current()) state.historyTimer = setTimeout(() => refreshHistory().then(renderCharts, () => {}),
                                                   HISTORY_REFRESH_MS);
  }
}

// ---- rendering ----

function period() { return $("period").value; }

function ledgerBase() { return period() === "total" ? ["ledger"] : ["ledger", "last_hour"]; }

function render() {
  const st = state.stats;
  const scoped = typeof st.tenant === "string";  // one tenant's figures (a tenant's key, or the admin's choice)
  $("board").hidden = false;
  $("forget").hidden = false;
  if (!scoped) state.tenantNames = Object.keys(st.ledger.by_tenant || {}).concat(Object.keys(st.by_tenant || {}))
    .filter((v, i, all) => all.indexOf(v) === i).sort();
  const adminKey = !scoped || state.view !== "";
  $("who").textContent = (adminKey ? "admin" : "tenant " + st.tenant) +
    (state.view ? " · viewing tenant " + state.view : adminKey ? " · the whole box" : "") +
    " · " + st.model.id + (st.profile ? " · profile " + st.profile : "");
  renderViewPicker(adminKey);
  renderTiles();
  renderLayers();
  renderTenants(scoped);
  renderNearCut();
  renderEngine(scoped);
  renderCharts();
}

function renderViewPicker(adminKey) {
  const select = $("view");
  $("view-label").hidden = !adminKey;
  if (!adminKey) return;
  const wanted = ["", ...state.tenantNames];
  const have = Array.from(select.options).map(o => o.value);
  if (JSON.stringify(wanted) !== JSON.stringify(have)) {
    select.replaceChildren(...wanted.map(name => h("option", {value: name}, name ? "tenant " + name : "the whole box")));
  }
  select.value = state.view;
}

function tile(label, value, detail) {
  return h("div", {class: "tile"}, h("div", {class: "label"}, label), h("div", {class: "value"}, value),
           detail ? h("div", {class: "detail"}, detail) : null);
}

function renderTiles() {
  const st = state.stats;
  const base = ledgerBase();
  const T = [...base, "total"];
  const total = at(st, T);
  const price = st.ledger.price;
  const currency = price ? price.currency : "";
  const since = period() === "total" ? st.ledger.since : st.ledger.last_hour.since;
  $("period-note").textContent = "since " + new Date(since * 1000).toLocaleString();
  const tokens = LAYERS.reduce((a, l) => a + total.saved[l].prompt_tokens + total.saved[l].completion_tokens, 0);
  const rate = hitRate(total.requests);
  const tiles = [
    tile("Engine time saved", fig([...T, "saved_engine_s"], fmtSeconds),
         h("span", {}, "spent ", fig([...T, "spent_engine_s"], fmtSeconds))),
    tile("Tokens not computed", derived("saved_tokens", tokens, fmtInt), "prompt and completion, all layers"),
    price ? tile("Money saved", fig([...T, "cost_saved_total"], v => fmtMoney(v, currency)),
                 h("span", {}, "spent ", fig([...T, "cost_spent"], v => fmtMoney(v, currency)), " · at ",
                   fig(["ledger", "price", "per_hour"], v => fmtMoney(v, currency)), " an hour"))
          : tile("Money saved", "—", "no box price: set ledger.price_per_hour"),
    tile("Effective capacity", fig([...T, "effective_capacity"], fmtTimes), "the work of this many boxes"),
    tile("The cache's share", fig([...T, "cache_share"], fmtShare), "of the work the box would have done"),
    tile("Hit rate", derived("hit_rate", rate, fmtShare), "exact, shared and semantic, of requests served"),
    tile("Requests", derived("requests", sum(total.requests), fmtInt),
         h("span", {}, fig([...T, "misses"], fmtInt), " misses")),
  ];
  if (!st.ledger.fit.ready) {
    tiles.push(tile("Engine time not priced yet", "…",
                    st.ledger.fit.why || "the engine's measured cost per token has too few calls under it yet"));
  }
  $("tiles").replaceChildren(...tiles);
}

function renderLayers() {
  const st = state.stats;
  const T = [...ledgerBase(), "total"];
  const total = at(st, T);
  const price = st.ledger.price;
  const currency = price ? price.currency : "";
  const saved = total.saved_engine_s;
  const head = h("tr", {}, h("th", {}, "layer"), h("th", {}, "requests served"), h("th", {}, "prompt tokens"),
                 h("th", {}, "completion tokens"), h("th", {}, "engine time"), price ? h("th", {}, "money") : null,
                 h("th", {}, "share of the time saved"));
  const rows = [head];
  for (const layer of LAYERS) {
    const P = [...T, "saved", layer];
    rows.push(h("tr", {}, h("td", {}, swatch(COLORS[layer]), LAYER_NAMES[layer]),
                h("td", {}, layer === "kv_prefix" ? "(part of misses)" : fig([...T, "requests", layer], fmtInt)),
                h("td", {}, fig([...P, "prompt_tokens"], fmtInt)), h("td", {}, fig([...P, "completion_tokens"], fmtInt)),
                h("td", {}, fig([...P, "engine_s"], fmtSeconds)),
                price ? h("td", {}, fig([...T, "cost_saved", layer], v => fmtMoney(v, currency))) : null,
                h("td", {}, derived("layer_share:" + layer, saved > 0 ? total.saved[layer].engine_s / saved : null,
                                    fmtShare))));
    if (layer === "kv_prefix") {
      for (const tier of Object.keys(total.kv_prefix.by_tier)) {
        const K = [...T, "kv_prefix", "by_tier", tier];
        rows.push(h("tr", {class: "sub"}, h("td", {}, "tier " + tier), h("td", {}), h("td", {}, fig([...K, "prompt_tokens"], fmtInt)),
                    h("td", {}), h("td", {}, fig([...K, "engine_s"], fmtSeconds)), price ? h("td", {}) : null,
                    h("td", {}, derived("tier_share:" + tier, saved > 0 ? total.kv_prefix.by_tier[tier].engine_s / saved : null,
                                        fmtShare))));
      }
    }
  }
  rows.push(h("tr", {}, h("th", {}, "spent, by purpose"), h("th", {}, "engine calls"), h("th", {}, "prompt tokens computed"),
              h("th", {}, "completion tokens"), h("th", {}, "engine time"), price ? h("th", {}) : null, h("th", {})));
  for (const purpose of Object.keys(total.spent)) {
    const P = [...T, "spent", purpose];
    rows.push(h("tr", {}, h("td", {}, swatch(COLORS.spent), purpose), h("td", {}, fig([...P, "calls"], fmtInt)),
                h("td", {}, fig([...P, "prompt_tokens"], fmtInt)), h("td", {}, fig([...P, "completion_tokens"], fmtInt)),
                h("td", {}, fig([...P, "engine_s"], fmtSeconds)), price ? h("td", {}) : null, h("td", {})));
  }
  $("layers").replaceChildren(...rows);
}

function renderTenants(scoped) {
  const st = state.stats;
  const base = [...ledgerBase(), "by_tenant"];
  const byTenant = at(st, base) || {};
  const names = Object.keys(byTenant).sort();
  const show = !scoped && state.view === "" && names.length > 0;
  $("tenants-section").hidden = !show;
  if (!show) { $("tenants").replaceChildren(); return; }
  const price = st.ledger.price;
  const currency = price ? price.currency : "";
  const rows = [h("tr", {}, h("th", {}, "tenant"), h("th", {}, "requests"), h("th", {}, "hit rate"),
                  h("th", {}, "misses"), h("th", {}, "engine time saved"), h("th", {}, "spent"),
                  h("th", {}, "the cache's share"), h("th", {}, "effective capacity"),
                  price ? h("th", {}, "money saved") : null)];
  for (const name of names) {
    const P = [...base, name];
    const t = byTenant[name];
    rows.push(h("tr", {}, h("td", {}, name), h("td", {}, derived("requests:" + name, sum(t.requests), fmtInt)),
                h("td", {}, derived("hit_rate:" + name, hitRate(t.requests), fmtShare)),
                h("td", {}, fig([...P, "misses"], fmtInt)), h("td", {}, fig([...P, "saved_engine_s"], fmtSeconds)),
                h("td", {}, fig([...P, "spent_engine_s"], fmtSeconds)), h("td", {}, fig([...P, "cache_share"], fmtShare)),
                h("td", {}, fig([...P, "effective_capacity"], fmtTimes)),
                price ? h("td", {}, fig([...P, "cost_saved_total"], v => fmtMoney(v, currency))) : null));
  }
  $("tenants").replaceChildren(...rows);
}

// ---- charts ----

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// A chart over time: bars stacked per point (each as wide as the minutes it covers) and lines through the points.
// ``stacks`` and ``lines``: [name, color, point -> value per minute (null: none)].
function timeChart(box, {start, end, points, stacks = [], lines = [], yFormat, yMax}) {
  const W = 1200, H = 230, L = 64, R = 12, T = 10, B = 24;
  const x = t => L + (W - L - R) * (t - start) / Math.max(1, end - start);
  let top = yMax || 0;
  if (!yMax) {
    for (const p of points) {
      top = Math.max(top, stacks.reduce((a, [, , f]) => a + (f(p) || 0), 0));
      for (const [, , f] of lines) top = Math.max(top, f(p) || 0);
    }
    top = niceMax(top);
  }
  const y = v => T + (H - T - B) * (1 - v / top);
  const svg = s("svg", {viewBox: `0 0 ${W} ${H}`, role: "img"});
  for (let i = 0; i <= 4; i++) {
    const v = top * i / 4;
    svg.append(s("line", {class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v)}),
               s("text", {x: L - 6, y: y(v) + 4, "text-anchor": "end"}, yFormat(v)));
  }
  const span = (end - start) / 60;
  const every = [5, 10, 15, 30, 60, 120, 180, 360].find(m => span / m <= 8) || 360;
  for (let t = Math.ceil(start / (every * 60)) * every * 60; t <= end; t += every * 60) {
    svg.append(s("line", {class: "axis", x1: x(t), x2: x(t), y1: H - B, y2: H - B + 4}),
               s("text", {x: x(t), y: H - 6, "text-anchor": "middle"}, fmtClock(t)));
  }
  svg.append(s("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}));
  for (const p of points) {
    const x0 = x(Math.max(start, p.at)), x1 = x(Math.min(end, p.at + p.minutes * 60));
    const width = Math.max(1, x1 - x0 - 1);
    let level = 0;
    const lines_ = [fmtClock(p.at) + (p.minutes >= 2 ? " (" + Math.round(p.minutes) + " min)" : "")];
    const group = s("g", {});
    for (const [name, color, f] of stacks) {
      const v = f(p) || 0;
      if (v > 0) {
        group.append(s("rect", {x: x0, width, y: y(level + v), height: Math.max(0.5, y(level) - y(level + v)), fill: color}));
        lines_.push(name + ": " + yFormat(v));
      }
      level += v;
    }
    for (const [name, , f] of lines) {
      const v = f(p);
      if (v !== null && v !== undefined) lines_.push(name + ": " + yFormat(v));
    }
    group.append(s("title", {}, lines_.join("\n")));
    svg.append(group);
  }
  for (const [, color, f] of lines) {
    let d = "";
    let open = false;
    for (const p of points) {
      const v = f(p);
      if (v === null || v === undefined || Number.isNaN(v)) { open = false; continue; }
      const cx = x(Math.min(end, p.at + p.minutes * 30));
      d += (open ? "L" : "M") + cx.toFixed(1) + " " + y(Math.min(v, top)).toFixed(1) + " ";
      open = true;
    }
    if (d) svg.append(s("path", {d, fill: "none", stroke: color, "stroke-width": 2, "stroke-linejoin": "round"}));
  }
  box.replaceChildren(svg, legend([...stacks, ...lines].map(([name, color]) => [name, color])));
}

function perMinute(f) { return p => p.minutes > 0 ? f(p) / Math.max(p.minutes, 1) : 0; }

function renderCharts() {
  const hist = state.history;
  if (!hist || !state.stats) return;
  const [minutes] = $("window").value.split(":");
  const end = hist.now, start = end - Number(minutes) * 60;
  const points = hist.points.filter(p => p.at + p.minutes * 60 > start);
  const price = hist.price;
  const win = hist.window;
  $("window-note").textContent = "over the window: saved " + fmtSeconds(win.saved_engine_s) + ", spent " +
    fmtSeconds(win.spent_engine_s) + (price ? " (" + fmtMoney(win.cost_saved_total, price.currency) + " saved at " +
    fmtMoney(price.per_hour, price.currency) + " an hour)" : "");
  const empty = text => h("div", {class: "empty"}, text);
  if (points.length === 0) {
    for (const id of ["chart-saved", "chart-hits", "chart-misses", "chart-busy"]) {
      $(id).replaceChildren(empty("Nothing yet in this window: the ledger keeps one point a minute."));
    }
    return;
  }
  const perMin = v => v >= 120 ? (v / 60).toFixed(v >= 600 ? 0 : 1) + " min" : v.toFixed(v > 0 && v < 10 ? 1 : 0) + " s";
  timeChart($("chart-saved"), {
    start, end, points, yFormat: perMin,
    stacks: LAYERS.map(l => ["saved: " + LAYER_NAMES[l], COLORS[l], perMinute(p => p.saved_engine_s[l] || 0)]),
    lines: [["spent", COLORS.spent, perMinute(p => sum(p.spent_engine_s))]],
  });
  const share = (num, den) => den > 0 ? num / den : null;
  const served = p => sum(p.requests) - (p.requests.error || 0) - (p.requests.rejected || 0);
  timeChart($("chart-hits"), {
    start, end, points, yMax: 1, yFormat: v => (v * 100).toFixed(0) + " %",
    lines: [
      ["all layers", COLORS.all, p => share((p.requests.exact || 0) + (p.requests.shared || 0) + (p.requests.semantic || 0), served(p))],
      ...["exact", "shared", "semantic"].map(l => [LAYER_NAMES[l], COLORS[l], p => share(p.requests[l] || 0, served(p))]),
      ["KV prefix (of prompt tokens)", COLORS.kv_prefix,
       p => share(sum(p.kv_prefix_tokens), sum(p.kv_prefix_tokens) + sum(p.spent_prompt_tokens))],
    ],
  });
  const reasons = [];
  for (const p of points) for (const r of Object.keys(p.misses)) if (!reasons.includes(r)) reasons.push(r);
  reasons.sort();
  if (reasons.length === 0) {
    $("chart-misses").replaceChildren(empty("No misses in this window."));
  } else {
    timeChart($("chart-misses"), {
      start, end, points, yFormat: v => (v >= 10 ? v.toFixed(0) : v.toFixed(1)) + "/min",
      stacks: reasons.map((r, i) => [r, PALETTE[i % PALETTE.length], perMinute(p => p.misses[r] || 0)]),
    });
  }
  const scoped = typeof state.stats.tenant === "string";
  timeChart($("chart-busy"), {
    start, end, points, yMax: 1, yFormat: v => (v * 100).toFixed(0) + " %",
    lines: [[scoped ? "engine time its calls took (share of each minute)" : "engine busy (share of each minute)",
             COLORS.busy, p => p.minutes > 0 ? sum(p.spent_engine_s) / (Math.max(p.minutes, 1) * 60) : null]],
  });
}

function histChart(box, edges, served, refused, threshold) {
  const W = 560, H = 170, L = 40, R = 8, T = 8, B = 22;
  const bins = edges.length;  // below the first edge, then one per pair of edges
  const bw = (W - L - R) / bins;
  const top = niceMax(Math.max(1, ...served.map((v, i) => v + refused[i])));
  const y = v => T + (H - T - B) * (1 - v / top);
  const svg = s("svg", {viewBox: `0 0 ${W} ${H}`, role: "img"});
  for (let i = 0; i <= 2; i++) {
    const v = top * i / 2;
    svg.append(s("line", {class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v)}),
               s("text", {x: L - 4, y: y(v) + 4, "text-anchor": "end"}, fmtInt(v)));
  }
  for (let i = 0; i < bins; i++) {
    const x0 = L + i * bw;
    const label = i === 0 ? "below " + edges[0] : edges[i - 1] + "–" + edges[i];
    const g = s("g", {}, s("title", {}, "similarity " + label + ": " + served[i] + " served, " + refused[i] + " refused"));
    if (served[i]) g.append(s("rect", {x: x0 + 1, width: bw - 2, y: y(served[i]), height: y(0) - y(served[i]), fill: COLORS.served}));
    if (refused[i]) g.append(s("rect", {x: x0 + 1, width: bw - 2, y: y(served[i] + refused[i]),
                                       height: y(served[i]) - y(served[i] + refused[i]), fill: COLORS.refused}));
    svg.append(g);
  }
  const xOf = v => v < edges[0] ? L + bw * (v / edges[0]) : L + bw * (1 + (v - edges[0]) / (edges[1] - edges[0]));
  for (const tick of [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]) {
    svg.append(s("text", {x: xOf(tick), y: H - 6, "text-anchor": "middle"}, tick.toFixed(1)));
  }
  if (threshold !== null && threshold !== undefined) {
    svg.append(s("line", {class: "cut", x1: xOf(threshold), x2: xOf(threshold), y1: T, y2: H - B},
                 s("title", {}, "cut " + threshold)));
  }
  svg.append(s("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}));
  box.append(svg);
}

function renderNearCut() {
  const nc = state.stats.semantic && state.stats.semantic.near_cut;
  const box = $("near-cut");
  const rows = nc ? Object.keys(nc.by_tenant_scenario) : [];
  if (rows.length === 0) {
    box.replaceChildren(h("div", {class: "empty"}, nc ? "No semantic lookup has found a candidate yet."
                                                       : "The semantic layer's figures are not in this view."));
    return;
  }
  const cards = [];
  for (const name of rows) {
    const P = ["semantic", "near_cut", "by_tenant_scenario", name];
    const row = nc.by_tenant_scenario[name];
    const card = h("div", {class: "cut-card"});
    card.append(h("h3", {}, name, h("span", {class: "note"}, " · decision " + nc.decision +
                                    (row.threshold !== null ? " · cut at cosine " + row.threshold : ""))));
    histChart(card, nc.edges, row.served, row.refused, row.threshold);
    card.append(legend([["served", COLORS.served], ["refused", COLORS.refused]]));
    const estimates = [];
    const target = row.target_false_hit_rate;
    const verdict = upper => target !== null && upper !== null && upper > target ? h("span", {class: "over"}, " over the target") : null;
    if (row.learner) {
      estimates.push(h("div", {}, "learner's estimate ", fig([...P, "learner", "false_hit_rate"], fmtShare),
                       " (upper ", fig([...P, "learner", "false_hit_upper"], fmtShare), ") of ",
                       fig([...P, "learner", "lookups"], fmtInt), " lookups",
                       verdict(row.learner.false_hit_upper)));
    }
    if (row.labelled && row.labelled.false_hit_rate !== null) {
      estimates.push(h("div", {}, "labelled served decisions ", fig([...P, "labelled", "false_hit_rate"], fmtShare),
                       " (95 % upper ", fig([...P, "labelled", "false_hit_upper_95"], fmtShare), ") of ",
                       fig([...P, "labelled", "served_labels"], fmtInt), " labels"));
    }
    if (estimates.length === 0) estimates.push(h("div", {}, "no false-hit estimate yet (no labels)"));
    card.append(h("div", {class: "estimate"}, "target ", fig([...P, "target_false_hit_rate"], fmtShare), estimates));
    cards.push(card);
  }
  box.replaceChildren(...cards);
}

function renderEngine(scoped) {
  const st = state.stats;
  const tiles = [];
  const lastHour = st.ledger.last_hour;
  const now = state.history ? state.history.now : Date.now() / 1000;
  const hourSpan = Math.min(3600, Math.max(1, now - lastHour.since));
  tiles.push(tile(scoped ? "Engine time its calls took" : "Engine busy",
                  derived("busy_share", lastHour.total.spent_engine_s / hourSpan, fmtShare), "share of the last hour"));
  if (!scoped) {
    tiles.push(tile("Misses computing", fig(["admission", "running"], fmtInt),
                    h("span", {}, "of ", fig(["admission", "max_running"], fmtInt), " at once")),
               tile("Queued for the engine", fig(["admission", "queued"], fmtInt),
                    h("span", {}, fig(["admission", "rejected"], fmtInt), " refused (429) since start")),
               tile("Answers in flight", fig(["inflight"], fmtInt), "being computed, with their followers"));
    const es = st.engine_state || {};
    if (typeof es.kv_usage_ratio === "number") {
      tiles.push(tile("KV cache in use", fig(["engine_state", "kv_usage_ratio"], fmtShare), "of the engine's budget"));
    }
    if (typeof es.upstream_prefix_cache_hit_ratio === "number") {
      tiles.push(tile("Upstream prefix-cache hits", fig(["engine_state", "upstream_prefix_cache_hit_ratio"], fmtShare),
                      "as the upstream reports it"));
    }
  }
  $("engine-tiles").replaceChildren(...tiles);

  const ttft = st.ttft;
  if (ttft && Object.keys(ttft).length) {
    const rows = [h("caption", {}, "Time to first token, by what served (since start)"),
                  h("tr", {}, h("th", {}, "served by"), h("th", {}, "requests"), h("th", {}, "p50"), h("th", {}, "p99"),
                    h("th", {}, "mean"))];
    for (const outcome of Object.keys(ttft)) {
      const P = ["ttft", outcome];
      rows.push(h("tr", {}, h("td", {}, outcome), h("td", {}, fig([...P, "count"], fmtInt)),
                  h("td", {}, fig([...P, "p50_s"], fmtSeconds)), h("td", {}, fig([...P, "p99_s"], fmtSeconds)),
                  h("td", {}, fig([...P, "mean_s"], fmtSeconds))));
    }
    $("ttft").replaceChildren(...rows);
  } else {
    $("ttft").replaceChildren(h("caption", {}, scoped ? "Time to first token: the box's figure, in the admin's view"
                                                      : "Time to first token: no request yet"));
  }

  const prefix = st.prefix_cache || {};
  const tiers = [];
  for (const usage of Object.values(prefix)) for (const t of Object.keys(usage)) if (!tiers.includes(t)) tiers.push(t);
  const rows = [h("caption", {}, "The engine's prefix cache, by tier")];
  if (tiers.length) {
    rows.push(h("tr", {}, h("th", {}, "tenant"), tiers.map(t => h("th", {}, t))));
    for (const name of Object.keys(prefix).sort()) {
      rows.push(h("tr", {}, h("td", {}, name), tiers.map(t => h("td", {}, fig(["prefix_cache", name, t], fmtBytes)))));
    }
  }
  const es = st.engine_state || {};
  const hitTiers = Object.keys(es).filter(k => k.startsWith("prefix_cache_hits_")).sort();
  if (hitTiers.length) {
    rows.push(h("tr", {}, h("th", {}, "calls that loaded a saved prefix"), h("th", {}, "")));
    for (const k of hitTiers) {
      rows.push(h("tr", {class: "sub"}, h("td", {}, "from " + k.slice("prefix_cache_hits_".length)),
                  h("td", {}, fig(["engine_state", k], fmtInt))));
    }
  }
  const T = [...ledgerBase(), "total", "kv_prefix", "by_tier"];
  const byTier = at(st, T) || {};
  if (Object.keys(byTier).length) {
    rows.push(h("tr", {}, h("th", {}, "prompt tokens it held"), h("th", {}, "")));
    for (const tier of Object.keys(byTier)) {
      rows.push(h("tr", {class: "sub"}, h("td", {}, tier), h("td", {}, fig([...T, tier, "prompt_tokens"], fmtInt))));
    }
  }
  if (rows.length === 1) rows.push(h("tr", {}, h("td", {}, "nothing kept by tier here")));
  $("prefix").replaceChildren(...rows);
}

// ---- start ----

function start() {
  $("key-form").addEventListener("submit", event => {
    event.preventDefault();
    useKey($("key").value.trim());
    $("key").value = "";
  });
  $("forget").addEventListener("click", () => showLogin(""));
  $("view").addEventListener("change", () => { state.view = $("view").value; state.history = null; refresh(true); });
  $("period").addEventListener("change", () => { if (state.stats) render(); });
  $("window").addEventListener("change", () => { if (state.stats) refreshHistory().then(renderCharts, () => {}); });
  document.addEventListener("visibilitychange", () => { if (!document.hidden && state.key !== null) refresh(true); });
  window.addEventListener("hashchange", () => { const k = keyFromFragment(); if (k !== null) useKey(k); });
  const key = keyFromFragment() ?? sessionStorage.getItem(KEY_SLOT);
  if (key === null) showLogin(""); else useKey(key);
}

start();
