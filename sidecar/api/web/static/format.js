// Small DOM and number helpers shared by the views. Text always goes in as text (never HTML), so
// names from traces and labels from users cannot inject markup.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export const TERMINAL = new Set(["completed", "degraded", "failed"]);
export const LIVE = new Set(["starting", "active", "stopping", "collecting"]);

export function us(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 1 : 2) + " s";
  if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e5 ? 0 : a >= 1e4 ? 1 : 2) + " ms";
  return v.toFixed(a >= 100 ? 0 : 1) + " µs";
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return (i === 0 ? String(v) : v.toFixed(v >= 100 ? 0 : 1)) + " " + units[i];
}

export function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return Math.round(s * 1000) + " ms";
  if (s < 120) return s.toFixed(s < 10 ? 1 : 0) + " s";
  const m = Math.floor(s / 60);
  if (m < 120) return `${m} min ${Math.round(s - m * 60)} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  const today = new Date();
  const time = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
  if (d.toDateString() === today.toDateString()) return time;
  return d.toLocaleDateString([], { year: "numeric", month: "short", day: "numeric" }) + " " + time;
}

export function between(a, b) {
  if (!a || !b) return null;
  return (new Date(b) - new Date(a)) / 1000;
}

export function clear(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

export function errorBox(err, extra) {
  const box = el("div", { class: "error-box", role: "alert" });
  box.append(el("strong", { text: err.code ? `${err.code}` : "error" }), " ", el("span", { class: "error-message", text: err.message }));
  const valid = err.details && err.details.valid;
  if (Array.isArray(valid)) box.append(el("div", { class: "muted", text: `valid stages: ${valid.join(", ") || "none"}` }));
  if (extra) box.append(extra);
  return box;
}
