// The Pingmesh dashboard: polls the analyzer's JSON API and the mesh overview
// every two seconds and redraws. No framework: a heatmap is a grid of coloured cells.
"use strict";

// Errors the page met, counted on <body data-errors> (the headless test reads it).
function noteError(what) {
  const body = document.body;
  body.dataset.errors = String(Number(body.dataset.errors || 0) + 1);
  body.dataset.lastError = String(what);
}
window.addEventListener("error", (e) => noteError(e.message));
window.addEventListener("unhandledrejection", (e) => noteError(e.reason));

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// Green at no RTT to red at `slow` µs and above; drops push to red at once.
function colour(cell, slowUs) {
  if (cell.drop_rate > 0.001) {
    const l = Math.max(30, 60 - cell.drop_rate * 60);
    return `hsl(0, 75%, ${l}%)`;
  }
  const x = Math.min(1, cell.rtt_p50_us / slowUs);
  return `hsl(${Math.round(120 - 120 * x)}, 65%, ${85 - 35 * x}%)`;
}

function drawHeatmap(report) {
  const table = document.getElementById("heatmap");
  const { nodes, cells } = report.heatmap;
  // The analyzer's "slow" bound is not in the report; 1 ms is its default.
  const slowUs = 1000;
  const head = el("tr", {}, el("th", {}, "prober \\ target"), ...nodes.map((n) => el("th", {}, n)));
  const rows = nodes.map((src, i) =>
    el("tr", {}, el("th", {}, src), ...nodes.map((dst, j) => {
      const attrs = { "data-src": src, "data-dst": dst };
      if (i === j) return el("td", { ...attrs, class: "cell self" }, "");
      const c = cells[i][j];
      if (!c) return el("td", { ...attrs, class: "cell empty" }, "–");
      const td = el("td", {
        ...attrs,
        class: "cell",
        "data-rtt-us": c.rtt_p50_us.toFixed(1),
        "data-drop": c.drop_rate.toFixed(3),
        title: `${src} → ${dst}: p50 ${c.rtt_p50_us.toFixed(1)} µs, p99 ${c.rtt_p99_us.toFixed(1)} µs, ${(c.drop_rate * 100).toFixed(1)} % dropped, ${c.probes} probes`,
      }, `${c.rtt_p50_us.toFixed(0)} µs`, el("br"), `${(c.drop_rate * 100).toFixed(1)} %`);
      td.style.background = colour(c, slowUs);
      return td;
    })));
  table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
  const s = report.cluster;
  document.getElementById("sla").textContent =
    `Cluster over ${report.window_ms / 1000} s: ${s.probes} probes, drop rate ${(s.drop_rate * 100).toFixed(2)} %, ` +
    `RTT p50 ${s.rtt_p50_us.toFixed(1)} µs, p99 ${s.rtt_p99_us.toFixed(1)} µs, p99.9 ${s.rtt_p999_us.toFixed(1)} µs.`;
}

function drawProblems(report) {
  const list = document.getElementById("problems");
  if (report.problems.length === 0) {
    list.replaceChildren(el("li", { class: "none" }, "none: every probe answered in time"));
    return;
  }
  list.replaceChildren(...report.problems.map((p) => {
    const impacts = p.impact.map((i) => el("span", {}, el("span", { class: `badge ${i.class}` }, i.class), i.service, " "));
    return el("li", { class: p.network ? "network" : "host", "data-kind": p.kind, "data-element": p.element },
      p.class ? el("span", { class: `badge ${p.class}` }, p.class) : "",
      el("span", { class: "kind" }, p.kind.replaceAll("_", " ")), ": ", p.element,
      " — ", el("span", { class: "evidence" }, p.evidence),
      impacts.length ? el("div", {}, "impact: ", ...impacts) : "");
  }));
}

function drawMesh(mesh) {
  const body = document.querySelector("#mesh tbody");
  const fmt = (m, digits) => Object.entries(m || {}).map(([k, v]) => `${k || "?"}: ${v.toFixed(digits)}`).join(", ") || "–";
  body.replaceChildren(...mesh.nodes.map((n) => {
    const chains = Array.isArray(n.chains)
      ? n.chains.map((c) => `${c.chain} (${(c.filters || []).map((f) => `${f.name}@${f.generation}`).join(", ")})`).join("; ")
      : "–";
    return el("tr", { "data-node": n.name },
      el("td", {}, n.name),
      n.up ? el("td", {}, "up") : el("td", { class: "down", title: n.error || "" }, "unreachable"),
      el("td", {}, n.generation ?? "–"),
      el("td", {}, n.pods),
      el("td", {}, n.request_rate.toFixed(1)),
      el("td", {}, chains),
      el("td", {}, fmt(n.denial_rate, 1)),
      el("td", {}, fmt(n.filter_latency_us, 1)));
  }));
}

async function getJson(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.json();
}

function drawGraph(mesh) {
  const wrap = document.getElementById("graph");
  if (!mesh.graph || mesh.graph.edges.length === 0) {
    wrap.replaceChildren(el("p", { class: "none" }, "no requests yet"));
    return;
  }
  wrap.replaceChildren(serviceGraph(mesh.graph));
}

function drawCharts(history) {
  const wrap = document.getElementById("charts");
  const rows = Object.entries(history.services).map(([service, points]) => {
    const series = (f) => points.map((p) => ({ t: p.t_ms, v: f(p) }));
    return el("div", { class: "chart-row", "data-service": service }, el("h3", {}, service),
      lineChart(series((p) => p.rps), { title: "req/s" }),
      lineChart(series((p) => p.success_rate * 100), { title: "success %", min: 0, max: 100, fmt: (v) => v.toFixed(1) }),
      lineChart(series((p) => p.p99_ms), { title: "p99 ms", fmt: (v) => v.toFixed(2) }));
  });
  wrap.replaceChildren(...(rows.length ? rows : [el("p", { class: "none" }, "no samples yet")]));
  const select = document.getElementById("pair");
  const pairs = Object.keys(history.pairs);
  const chosen = select.value || pairs[0] || "";
  select.replaceChildren(...pairs.map((p) => el("option", { value: p, selected: p === chosen }, p)));
  const points = history.pairs[chosen] || [];
  document.getElementById("pair-charts").replaceChildren(
    lineChart(points.map((p) => ({ t: p.t_ms, v: p.rtt_p50_us })), { title: `${chosen} RTT p50 µs` }),
    lineChart(points.map((p) => ({ t: p.t_ms, v: p.drop_rate * 100 })), { title: "drops %", fmt: (v) => v.toFixed(2) }));
}

// The tap: the form's query polled every half second while it runs.
const tap = { query: null, since: 0, timer: null };

function tapQuery() {
  const form = new FormData(document.getElementById("tap-form"));
  const q = new URLSearchParams();
  for (const [k, v] of form) if (v) q.set(k, v);
  return q.toString();
}

function startTap(query) {
  tap.query = query;
  tap.since = 0;
  document.querySelector("#tap tbody").replaceChildren();
  clearInterval(tap.timer);
  tap.timer = setInterval(pollTap, 500);
  pollTap();
}

async function pollTap() {
  if (tap.query === null) return;
  const page = await getJson(`/v1/tap?${tap.query}&since=${tap.since}`);
  tap.since = page.next;
  document.getElementById("tap-state").textContent =
    `tapping ${page.query}${page.errors.length ? " · " + page.errors.join("; ") : ""}`;
  const body = document.querySelector("#tap tbody");
  for (const r of page.records) {
    const filters = (r.filters || []).map((f) => `${f.filter} ${f.us.toFixed(0)}`).join(", ");
    body.prepend(el("tr", { class: `tap-row s${Math.floor(r.status / 100)}xx`, "data-status": r.status },
      el("td", {}, new Date(r.start_ms).toLocaleTimeString()),
      el("td", {}, r.node),
      el("td", {}, `${r.source} → ${r.service}`),
      el("td", {}, `${r.method} ${r.path}`),
      el("td", {}, r.status),
      el("td", {}, (r.duration_us / 1000).toFixed(2)),
      el("td", {}, r.denied_by ? `denied by ${r.denied_by}` : r.verdict),
      el("td", {}, filters)));
  }
  while (body.children.length > 200) body.lastChild.remove();
}

document.getElementById("tap-form").addEventListener("submit", (e) => {
  e.preventDefault();
  startTap(tapQuery());
});
document.getElementById("tap-stop").addEventListener("click", () => {
  clearInterval(tap.timer);
  tap.query = null;
  document.getElementById("tap-state").textContent = "off";
});
// `?tap=1&status=5xx` opens the page tapping (links from alerts, the headless test).
{
  const params = new URLSearchParams(location.search);
  if (params.get("tap")) {
    params.delete("tap");
    for (const [k, v] of params) {
      const input = document.querySelector(`#tap-form [name="${k}"]`);
      if (input) input.value = v;
    }
    startTap(tapQuery());
  }
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [report, mesh, history] = await Promise.all([getJson("/v1/report"), getJson("/v1/mesh"), getJson("/v1/history")]);
    drawProblems(report);
    drawHeatmap(report);
    drawMesh(mesh);
    drawGraph(mesh);
    drawCharts(history);
    document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
    status.textContent = `updated ${new Date(report.at_ms).toLocaleTimeString()} · ${report.probes} probes in the window`;
  } catch (e) {
    // The analyzer restarting is not a page error: say so and try again.
    status.textContent = `cannot reach the analyzer (${e.message}); retrying`;
  }
}

refresh();
setInterval(refresh, 2000);
