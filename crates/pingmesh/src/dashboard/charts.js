// The dashboard's drawing: a line chart and a service graph, in SVG. A few dozen
// lines of our own, served with the page (no CDN, nothing fetched from elsewhere).
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, ...children) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// A line chart of `points` ({t, v}; v may be null for a gap) in an SVG of width w
// and height h, labelled `title` with the last value formatted by `fmt`.
function lineChart(points, { w = 320, h = 110, title = "", fmt = (v) => v.toFixed(1), min = 0, max } = {}) {
  const pad = { l: 40, r: 8, t: 18, b: 16 };
  const svg = svgEl("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}`, class: "chart", "data-title": title, "data-points": points.length });
  const values = points.map((p) => p.v).filter((v) => v !== null && Number.isFinite(v));
  const top = max ?? Math.max(1e-9, ...values) * 1.1;
  const t0 = points.length ? points[0].t : 0;
  const t1 = points.length ? points[points.length - 1].t : 1;
  const x = (t) => pad.l + ((t - t0) / Math.max(1, t1 - t0)) * (w - pad.l - pad.r);
  const y = (v) => h - pad.b - ((v - min) / Math.max(1e-9, top - min)) * (h - pad.t - pad.b);
  svg.append(svgEl("rect", { x: pad.l, y: pad.t, width: w - pad.l - pad.r, height: h - pad.t - pad.b, class: "plot" }));
  let d = "";
  let pen = false;
  for (const p of points) {
    if (p.v === null || !Number.isFinite(p.v)) { pen = false; continue; }
    d += `${pen ? "L" : "M"}${x(p.t).toFixed(1)},${y(p.v).toFixed(1)} `;
    pen = true;
  }
  svg.append(svgEl("path", { d: d.trim(), class: "line" }));
  const last = values.length ? fmt(values[values.length - 1]) : "–";
  svg.append(svgEl("text", { x: pad.l, y: 12, class: "title" }, `${title}: ${last}`));
  svg.append(svgEl("text", { x: pad.l - 4, y: pad.t + 8, class: "axis", "text-anchor": "end" }, fmt(top)));
  svg.append(svgEl("text", { x: pad.l - 4, y: h - pad.b, class: "axis", "text-anchor": "end" }, fmt(min)));
  const span = Math.round((t1 - t0) / 60000);
  svg.append(svgEl("text", { x: w - pad.r, y: h - 3, class: "axis", "text-anchor": "end" }, `${span} min`));
  return svg;
}

// The service graph: callers on the left, the services they call to the right,
// layered by distance from the mesh's edge (`ingress`); each edge labelled with its
// rate, success rate and p99.
function serviceGraph(graph, { w = 720, rowH = 56 } = {}) {
  const depth = new Map();
  const roots = graph.nodes.filter((n) => !graph.edges.some((e) => e.destination === n && e.source !== n));
  for (const r of roots) depth.set(r, 0);
  for (let round = 0; round < graph.nodes.length; round++) {
    for (const e of graph.edges) {
      if (depth.has(e.source) && e.source !== e.destination) {
        const d = depth.get(e.source) + 1;
        if (!depth.has(e.destination) || depth.get(e.destination) < d) depth.set(e.destination, Math.min(d, graph.nodes.length));
      }
    }
  }
  for (const n of graph.nodes) if (!depth.has(n)) depth.set(n, 0);
  const layers = [];
  for (const [n, d] of depth) (layers[d] ||= []).push(n);
  const cols = layers.length || 1;
  const rows = Math.max(1, ...layers.map((l) => (l ? l.length : 0)));
  const h = rows * rowH + 20;
  const pos = new Map();
  layers.forEach((layer, d) => (layer || []).sort().forEach((n, i) => {
    pos.set(n, { x: 70 + (d * (w - 140)) / Math.max(1, cols - 1), y: 20 + i * rowH + rowH / 2 });
  }));
  const svg = svgEl("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}`, id: "graph-svg" });
  svg.append(svgEl("defs", {}, svgEl("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto" }, svgEl("path", { d: "M0,0 L10,5 L0,10 z" }))));
  for (const e of graph.edges) {
    const a = pos.get(e.source), b = pos.get(e.destination);
    if (!a || !b) continue;
    const bad = e.success_rate < 0.99;
    const p99 = e.p99_ms === null || e.p99_ms === undefined ? "–" : `${e.p99_ms.toFixed(1)} ms`;
    const label = `${e.rps.toFixed(1)}/s · ${(e.success_rate * 100).toFixed(1)} % · p99 ${p99}`;
    svg.append(svgEl("g", { class: `edge${bad ? " bad" : ""}`, "data-src": e.source, "data-dst": e.destination, "data-rps": e.rps.toFixed(3), "data-total": e.requests_total },
      svgEl("line", { x1: a.x + 45, y1: a.y, x2: b.x - 45, y2: b.y, "marker-end": "url(#arrow)" }),
      svgEl("text", { x: (a.x + b.x) / 2, y: (a.y + b.y) / 2 - 6, "text-anchor": "middle" }, label),
      svgEl("title", {}, `${e.source} → ${e.destination}: ${label}, ${e.requests_total} in all`)));
  }
  for (const [n, p] of pos) {
    svg.append(svgEl("g", { class: "node", "data-node": n },
      svgEl("rect", { x: p.x - 45, y: p.y - 14, width: 90, height: 28, rx: 6 }),
      svgEl("text", { x: p.x, y: p.y + 4, "text-anchor": "middle" }, n)));
  }
  return svg;
}
