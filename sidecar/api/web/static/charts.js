// Charts as inline SVG built with the DOM (no library, no inline styles: the CSP forbids them).
// Each chart takes plain rows and returns an <figure> holding one <svg>; nothing is drawn for
// rows that are absent.
import { el } from "./format.js";

const NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  for (const c of children) if (c) node.append(c);
  return node;
}

function text(x, y, s, attrs = {}) {
  const t = svg("text", { x, y, ...attrs });
  t.textContent = s;
  return t;
}

function clip(s, n) {
  return s.length <= n ? s : s.slice(0, n - 1) + "…";
}

// a label column as wide as the longest label needs (11.5 px monospace: about 7 units a
// character), between min and max; a longer label is clipped there and read whole in its tooltip
const CHAR_W = 7;
function labelColumn(rows, min, max) {
  const longest = Math.max(0, ...rows.map((r) => String(r.label).length));
  return Math.min(max, Math.max(min, 12 + CHAR_W * longest));
}

function figure(title, node, note) {
  return el("figure", { class: "chart" }, el("figcaption", { text: title }), node, note ? el("p", { class: "chart-note muted", text: note }) : null);
}

// rows: [{label, value, note?}] → horizontal bars, longest first, value printed by fmt
export function barChart(title, rows, { fmt = String, cls = "bar-cpu", width = 560, labelWidth = 236, note } = {}) {
  rows = rows.filter((r) => r.value > 0);
  if (!rows.length) return null;
  const rowH = 22;
  const top = 4;
  const valueW = 86;
  const barW = width - labelWidth - valueW - 8;
  const max = Math.max(...rows.map((r) => r.value));
  const height = top + rows.length * rowH + 4;
  const root = svg("svg", {
    class: "chart-svg",
    viewBox: `0 0 ${width} ${height}`,
    width,  // its own size at most (.chart-svg: max-width 100%): a lone chart in a row is not blown up
    role: "img",
    "aria-label": title,
    preserveAspectRatio: "xMinYMin meet",
  });
  rows.forEach((r, i) => {
    const y = top + i * rowH;
    const w = Math.max(1, (r.value / max) * barW);
    const g = svg("g", { class: "bar-row" });
    g.append(svg("title", {}, document.createTextNode(`${r.label}\n${fmt(r.value)}${r.note ? " · " + r.note : ""}`)));
    g.append(text(labelWidth - 8, y + 15, clip(r.label, 32), { class: "bar-label", "text-anchor": "end" }));
    g.append(svg("rect", { class: "bar-track", x: labelWidth, y: y + 3, width: barW, height: rowH - 6, rx: 3 }));
    g.append(svg("rect", { class: `bar ${cls}`, x: labelWidth, y: y + 3, width: w.toFixed(1), height: rowH - 6, rx: 3 }));
    g.append(text(labelWidth + barW + 8, y + 15, fmt(r.value), { class: "bar-value" }));
    root.append(g);
  });
  return figure(title, root, note);
}

// rows: [{label, busy_us, idle_share}] → one 100 % bar per device: busy (coloured) vs idle
export function busyIdleChart(title, rows, { width = 560, labelWidth } = {}) {
  if (!rows.length) return null;
  labelWidth = labelWidth ?? labelColumn(rows, 150, 300);
  const rowH = 26;
  const barW = width - labelWidth - 170;
  const height = 4 + rows.length * rowH + 18;
  const root = svg("svg", { class: "chart-svg", viewBox: `0 0 ${width} ${height}`, width, role: "img", "aria-label": title });
  rows.forEach((r, i) => {
    const y = 4 + i * rowH;
    const busy = Math.min(1, Math.max(0, 1 - (r.idle_share ?? 0)));
    const g = svg("g", { class: "bar-row" });
    g.append(svg("title", {}, document.createTextNode(`${r.label}: busy ${(busy * 100).toFixed(1)} %, idle ${((1 - busy) * 100).toFixed(1)} %`)));
    g.append(text(labelWidth - 8, y + 17, clip(r.label, Math.floor((labelWidth - 12) / CHAR_W)), { class: "bar-label", "text-anchor": "end" }));
    g.append(svg("rect", { class: "bar bar-idle", x: labelWidth, y: y + 4, width: barW, height: rowH - 8, rx: 3 }));
    g.append(svg("rect", { class: "bar bar-busy", x: labelWidth, y: y + 4, width: Math.max(1, busy * barW).toFixed(1), height: rowH - 8, rx: 3 }));
    g.append(text(labelWidth + barW + 8, y + 17, `${(busy * 100).toFixed(0)} % busy · ${r.busyText}`, { class: "bar-value" }));
    root.append(g);
  });
  const ly = height - 6;
  root.append(svg("rect", { class: "bar bar-busy", x: labelWidth, y: ly - 9, width: 10, height: 10, rx: 2 }));
  root.append(text(labelWidth + 14, ly, "busy", { class: "legend" }));
  root.append(svg("rect", { class: "bar bar-idle", x: labelWidth + 60, y: ly - 9, width: 10, height: 10, rx: 2 }));
  root.append(text(labelWidth + 74, ly, "idle", { class: "legend" }));
  return figure(title, root);
}

// rows: [{label, shares: {key: 0..1}}], parts: [{key, name, cls}] → one 100 % bar per row, its
// segments in the order of parts (what the summary's `temporal` / `idle_breakdown` split)
export function stackedChart(title, rows, parts, { width = 560, labelWidth } = {}) {
  rows = rows.filter((r) => parts.some((p) => (r.shares[p.key] ?? 0) > 0));
  if (!rows.length) return null;
  labelWidth = labelWidth ?? labelColumn(rows, 150, 300);
  const rowH = 26;
  const barW = width - labelWidth - 12;
  const height = 4 + rows.length * rowH + 20;
  const root = svg("svg", { class: "chart-svg stacked", viewBox: `0 0 ${width} ${height}`, width, role: "img", "aria-label": title });
  rows.forEach((r, i) => {
    const y = 4 + i * rowH;
    const g = svg("g", { class: "bar-row" });
    g.append(svg("title", {}, document.createTextNode(r.label)));
    g.append(text(labelWidth - 8, y + 17, clip(r.label, Math.floor((labelWidth - 12) / CHAR_W)), { class: "bar-label", "text-anchor": "end" }));
    g.append(svg("rect", { class: "bar-track", x: labelWidth, y: y + 4, width: barW, height: rowH - 8, rx: 3 }));
    let x = labelWidth;
    for (const p of parts) {
      const share = Math.min(1, Math.max(0, r.shares[p.key] ?? 0));
      if (share <= 0) continue;
      const w = share * barW;
      const seg = svg("rect", { class: `seg ${p.cls}`, x: x.toFixed(1), y: y + 4, width: Math.max(0.5, w).toFixed(1), height: rowH - 8, "data-part": p.key });
      seg.append(svg("title", {}, document.createTextNode(`${r.label}: ${p.name} ${(share * 100).toFixed(1)} %`)));
      g.append(seg);
      x += w;
    }
    root.append(g);
  });
  // under the bars, moved left where a wide label column would push it past the edge
  const legendW = parts.reduce((w, p) => w + 22 + p.name.length * CHAR_W, 0) - 8;
  let lx = Math.max(0, Math.min(labelWidth, width - legendW));
  const ly = height - 6;
  for (const p of parts) {
    root.append(svg("rect", { class: `seg ${p.cls}`, x: lx, y: ly - 9, width: 10, height: 10, rx: 2 }));
    root.append(text(lx + 14, ly, p.name, { class: "legend" }));
    lx += 22 + p.name.length * CHAR_W;
  }
  return figure(title, root);
}

// series: [{label, cls, points: [[x, y], ...], dashed?}] → lines over one x axis (µs from the
// window's start) and one y axis from 0; each solid series marks its highest point (its peak)
export function lineChart(title, series, { xFmt = String, yFmt = String, width = 560, height = 210, note } = {}) {
  series = series.filter((s) => s.points && s.points.length);
  if (!series.length) return null;
  const left = 78;
  const right = 14;
  const top = 12;
  const plotH = height - top - 52;
  const plotW = width - left - right;
  const xs = series.flatMap((s) => s.points.map((p) => p[0]));
  const ys = series.flatMap((s) => s.points.map((p) => p[1]));
  const x0 = Math.min(...xs);
  const x1 = Math.max(...xs);
  const yMax = Math.max(...ys) || 1;
  const px = (x) => left + (x1 > x0 ? ((x - x0) / (x1 - x0)) * plotW : plotW / 2);
  const py = (y) => top + plotH - (y / yMax) * plotH;
  const root = svg("svg", { class: "chart-svg line-chart", viewBox: `0 0 ${width} ${height}`, width, role: "img", "aria-label": title });
  for (const f of [0, 0.5, 1]) {
    const y = py(f * yMax);
    root.append(svg("line", { class: "grid-line", x1: left, x2: left + plotW, y1: y.toFixed(1), y2: y.toFixed(1) }));
    root.append(text(left - 6, y + 4, yFmt(f * yMax), { class: "bar-value", "text-anchor": "end" }));
  }
  root.append(text(left, top + plotH + 16, xFmt(x0), { class: "bar-value" }));
  root.append(text(left + plotW, top + plotH + 16, xFmt(x1), { class: "bar-value", "text-anchor": "end" }));
  series.forEach((s, i) => {
    const g = svg("g", { class: "series", "data-series": s.label });
    const pts = s.points.map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
    const line = svg("polyline", { class: `line ${s.cls || ""} ${s.dashed ? "line-dashed" : ""}`.trim(), points: pts });
    line.append(svg("title", {}, document.createTextNode(s.label)));
    g.append(line);
    if (!s.dashed) {
      const peak = s.points.reduce((a, b) => (b[1] > a[1] ? b : a));
      const dot = svg("circle", { class: `peak-dot ${s.cls || ""}`.trim(), cx: px(peak[0]).toFixed(1), cy: py(peak[1]).toFixed(1), r: 3.5, "data-peak": peak[1] });
      dot.append(svg("title", {}, document.createTextNode(`${s.label}: peak ${yFmt(peak[1])} at ${xFmt(peak[0])}`)));
      g.append(dot);
      g.append(text(Math.min(px(peak[0]) + 6, left + plotW - 60), Math.max(py(peak[1]) - 6, top + 10), yFmt(peak[1]), { class: "peak-label" }));
    }
    root.append(g);
    const ly = height - 18;
    const lx = left + (i * plotW) / series.length;
    root.append(svg("line", { class: `line ${s.cls || ""} ${s.dashed ? "line-dashed" : ""}`.trim(), x1: lx, x2: lx + 14, y1: ly - 4, y2: ly - 4 }));
    root.append(text(lx + 18, ly, clip(s.label, Math.max(8, Math.floor(plotW / series.length / 7) - 3)), { class: "legend" }));
  });
  return figure(title, root, note);
}
