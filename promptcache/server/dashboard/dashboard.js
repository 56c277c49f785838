// promptcache dashboard: polls the server's JSON endpoints and draws plain SVG charts.
// No external assets: everything here is served by the server itself.
"use strict";

const POLL_MS = 2000;
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed"];
const evictionHistory = []; // [time, total evictions] sampled at each poll

function headers() {
  const key = localStorage.getItem("promptcache-key");
  return key ? { Authorization: "Bearer " + key } : {};
}

async function getJSON(path) {
  const res = await fetch(path, { headers: headers() });
  if (res.status === 401) {
    document.getElementById("keyform").hidden = false;
    throw new Error("this server needs an API key: enter one above");
  }
  if (!res.ok) {
    const err = new Error(path + ": HTTP " + res.status);
    err.status = res.status;
    throw err;
  }
  return res.json();
}

function el(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmtNum(n) {
  if (n === null || n === undefined) return "–";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (Math.abs(n) >= 1e3) return (n / 1e3).toFixed(1) + "K";
  return String(Math.round(n * 100) / 100);
}

function fmtPct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
function fmtS(x) { return x === null || x === undefined ? "–" : x < 1 ? (1000 * x).toFixed(0) + " ms" : x.toFixed(2) + " s"; }

// series: [{name, points: [[x, y], ...]}]; opts: {yMax, yFmt, xFmt, bars}
function drawChart(id, series, opts) {
  const box = document.getElementById(id);
  box.replaceChildren();
  const all = series.flatMap((s) => s.points);
  box.dataset.points = String(all.length);
  if (!all.length) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = opts.empty || "no data yet";
    box.appendChild(empty);
    return;
  }
  const W = 400, H = 150, L = 44, B = 18, T = 6, R = 8;
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const top = Math.max(...ys);
  const y1 = opts.yMax !== undefined ? opts.yMax : top > 0 ? top * 1.1 : 1;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - (y / y1) * (H - B - T);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  for (const f of [0, 0.5, 1]) {
    const y = sy(f * y1);
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: y, y2: y, stroke: "#e5e7eb" }));
    svg.appendChild(el("text", { x: L - 4, y: y + 4, "text-anchor": "end", "font-size": 10, fill: "#6b7280" }, (opts.yFmt || fmtNum)(f * y1)));
  }
  svg.appendChild(el("text", { x: L, y: H - 4, "font-size": 10, fill: "#6b7280" }, (opts.xFmt || fmtNum)(x0)));
  svg.appendChild(el("text", { x: W - R, y: H - 4, "text-anchor": "end", "font-size": 10, fill: "#6b7280" }, (opts.xFmt || fmtNum)(x1)));
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    if (opts.bars) {
      const w = Math.max(2, (W - L - R) / Math.max(1, s.points.length) - 2);
      s.points.forEach(([x, y]) => svg.appendChild(el("rect", { class: "point", x: sx(x) - w / 2, y: sy(y), width: w, height: H - B - sy(y), fill: color })));
      return;
    }
    const d = s.points.map(([x, y], j) => `${j ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
    svg.appendChild(el("path", { class: "series", d, fill: "none", stroke: color, "stroke-width": 1.6 }));
    for (const [x, y] of s.points) svg.appendChild(el("circle", { class: "point", cx: sx(x), cy: sy(y), r: 1.8, fill: color }));
  });
  box.appendChild(svg);
  const legend = document.createElement("div");
  legend.className = "legend";
  series.forEach((s, i) => {
    const item = document.createElement("span");
    const sw = document.createElement("i");
    sw.className = "swatch";
    sw.style.background = s.color || COLORS[i % COLORS.length];
    item.append(sw, s.name);
    legend.appendChild(item);
  });
  box.appendChild(legend);
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function render(data, stats) {
  const reqs = data.requests.slice().reverse(); // oldest first
  const alert = data.alert;
  const banner = document.getElementById("banner");
  banner.hidden = !alert.alerting;
  banner.textContent = alert.alerting
    ? `Cache hit rate ${fmtPct(alert.window_hit_rate)} over the last ${alert.requests_in_window} requests is under the alert threshold of ${fmtPct(alert.threshold)}: see the miss reasons below.`
    : "";
  const reused = reqs.reduce((a, r) => a + r.cached_tokens, 0);
  const saved = reqs.reduce((a, r) => a + r.saved_s, 0);
  document.getElementById("t-window").textContent = fmtPct(alert.window_hit_rate);
  document.getElementById("t-reused").textContent = fmtNum(reused);
  document.getElementById("t-saved").textContent = fmtS(saved);
  document.getElementById("t-requests").textContent = fmtNum(reqs.length);

  const perReq = reqs.map((r) => [r.id, r.prompt_tokens ? r.cached_tokens / r.prompt_tokens : 0]);
  const windowPts = [];
  let win = [];
  for (const r of reqs) {
    win.push(r);
    if (win.length > alert.window_requests) win.shift();
    const p = win.reduce((a, x) => a + x.prompt_tokens, 0);
    windowPts.push([r.id, p ? win.reduce((a, x) => a + x.cached_tokens, 0) / p : 0]);
  }
  drawChart("chart-hit", [
    { name: "per request", points: perReq },
    { name: `window of ${alert.window_requests}`, points: windowPts },
    { name: "alert threshold", color: "#9ca3af", points: reqs.length ? [[reqs[0].id, alert.threshold], [reqs[reqs.length - 1].id, alert.threshold]] : [] },
  ], { yMax: 1, yFmt: fmtPct, xFmt: (x) => "#" + Math.round(x) });
  let cum = 0;
  drawChart("chart-saved", [{ name: "tokens reused", points: reqs.map((r) => [r.time, (cum += r.cached_tokens)]) }], { xFmt: clock });
  const timed = reqs.filter((r) => r.ttft_s !== null);
  drawChart("chart-ttft", [
    { name: "measured", points: timed.map((r) => [r.id, r.ttft_s]) },
    { name: "estimated without cache", points: timed.map((r) => [r.id, r.ttft_uncached_s]) },
  ], { yFmt: (y) => y.toFixed(2), xFmt: (x) => "#" + Math.round(x) });

  const reasons = document.getElementById("reasons");
  reasons.replaceChildren();
  for (const [k, v] of Object.entries(data.misses_by_reason)) {
    if (!v) continue;
    const s = document.createElement("span");
    s.innerHTML = `<span class="reason ${k}"></span> `;
    s.firstChild.textContent = k;
    s.append(String(v));
    reasons.appendChild(s);
  }

  const body = document.querySelector("#requests tbody");
  body.replaceChildren();
  for (const r of data.requests.slice(0, 100)) {
    const tr = document.createElement("tr");
    const tiers = Object.entries(r.tokens_by_tier || {}).filter(([, v]) => v).map(([k, v]) => `${k} ${fmtNum(v)}`).join(", ");
    const cells = [r.id, clock(r.time), r.tenant || "(default)", fmtNum(r.prompt_tokens), `${fmtNum(r.cached_tokens)} (${fmtPct(r.prompt_tokens ? r.cached_tokens / r.prompt_tokens : 0)})`, tiers || "–", fmtS(r.ttft_s), fmtS(r.ttft_uncached_s)];
    cells.forEach((c, i) => { const td = document.createElement("td"); td.textContent = c; if (i === 0 || i === 3) td.className = "num"; tr.appendChild(td); });
    const rc = document.createElement("td");
    const badge = document.createElement("span");
    badge.className = "reason " + r.reason;
    badge.textContent = r.reason;
    rc.appendChild(badge);
    tr.appendChild(rc);
    const dc = document.createElement("td");
    dc.textContent = describe(r);
    tr.appendChild(dc);
    body.appendChild(tr);
  }

  if (stats) renderStats(stats);
}

function describe(r) {
  const d = r.detail || {};
  switch (r.reason) {
    case "diverged": {
      const where = d.message_index >= 0 ? `, message ${d.message_index} (${d.role})` : "";
      return `token ${d.token_index}${where} vs request #${d.earlier_request}: …${d.before}⟦${d.found}⟧ expected ⟦${d.expected}⟧`;
    }
    case "image": {
      const where = d.message_index >= 0 ? `, message ${d.message_index} (${d.role})` : "";
      return `image differs at token ${d.token_index}${where} vs request #${d.earlier_request}`;
    }
    case "evicted":
      return `evicted from ${d.tier} ${fmtS(d.seconds_ago)} ago (request #${d.earlier_request} had ${d.earlier_tokens} tokens)`;
    case "in_flight":
      return `request #${d.earlier_request} (${d.earlier_tokens} tokens) was still running when this one looked up`;
    case "unsaved":
      return `request #${d.earlier_request} had ${d.earlier_tokens} tokens, no longer cached`;
    case "snapshot":
      return `cache held ${d.cached_tokens} tokens; resumed at the checkpoint at ${d.checkpoint_at}`;
    case "namespace":
      return `namespace ${d.namespace || "(default)"} holds ${d.shared_tokens} tokens`;
    case "damaged":
      return `${d.damaged_blocks} damaged block(s) quarantined`;
    case "cold":
      return d.first_seen ? "prefix never seen" : `${d.missed_tokens} new tokens`;
    default:
      return "";
  }
}

function renderStats(stats) {
  document.getElementById("t-evictions").textContent = fmtNum(stats.num_evictions);
  evictionHistory.push([Date.now() / 1000, stats.num_evictions]);
  if (evictionHistory.length > 300) evictionHistory.shift();
  drawChart("chart-evictions", [{ name: "evictions (total)", points: evictionHistory.slice() }], { xFmt: clock });
  const curve = stats.whatif_hit_rate_by_budget || {};
  const pts = Object.entries(curve).map(([k, v]) => [parseFloat(k), v]).sort((a, b) => a[0] - b[0]);
  drawChart("chart-whatif", [{ name: `leader: ${stats.policy_leader || stats.policy}`, points: pts }], { yMax: 1, yFmt: fmtPct, xFmt: (x) => x + "x budget", empty: "no what-if curve (policy without simulations, or too little traffic)" });
  const tiers = document.getElementById("tiers");
  tiers.replaceChildren();
  const bytes = stats.bytes_by_tier || {};
  // RAM: token hit rate of every lookup; a lower tier: lookups it served / lookups that asked it
  const rows = [["tier", "bytes", "hits", "hit rate", "budget"]];
  rows.push(["ram", fmtNum(bytes.ram), fmtNum(stats.num_hits), fmtPct(stats.hit_rate), fmtNum(stats.ram_budget_bytes)]);
  for (const [name, t] of Object.entries(stats.tiers || {})) {
    const asked = (t.num_hits || 0) + (t.num_misses || 0);
    rows.push([name, fmtNum(bytes[name] ?? t.used_bytes), fmtNum(t.num_hits), asked ? fmtPct(t.num_hits / asked) : "–", fmtNum(t.budget_bytes)]);
  }
  const table = document.createElement("table");
  rows.forEach((row, i) => {
    const tr = document.createElement("tr");
    row.forEach((c) => { const td = document.createElement(i ? "td" : "th"); td.textContent = c; tr.appendChild(td); });
    table.appendChild(tr);
  });
  tiers.dataset.points = String(rows.length - 1);
  tiers.appendChild(table);
}

async function poll() {
  const error = document.getElementById("error");
  try {
    const data = await getJSON("/v1/cache/requests?limit=500");
    let stats = null;
    try {
      stats = await getJSON("/v1/cache/stats");
    } catch (e) {
      if (e.status !== 403) throw e; // a tenant key: server-wide figures need an admin key
    }
    document.getElementById("model").textContent = data.model || "";
    render(data, stats);
    error.hidden = true;
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.ready = "1";
  } catch (e) {
    error.hidden = false;
    error.textContent = String(e.message || e);
  }
}

document.getElementById("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  localStorage.setItem("promptcache-key", document.getElementById("key").value);
  document.getElementById("keyform").hidden = true;
  poll();
});

poll();
setInterval(poll, POLL_MS);
