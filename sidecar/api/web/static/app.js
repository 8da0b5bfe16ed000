// Entry point: picks the view from the path (relative to <base>), wires the token dialog and the
// header's upstream status. Every view only calls the sidecar's JSON API.
import { api, authRequired, onTokenNeeded, token } from "./api.js";
import { captureView } from "./capture.js";
import { capturesView } from "./captures.js";
import { clear, el } from "./format.js";
import { startHeartbeats } from "./leases.js";
import { stagesView } from "./stages.js";

const AUTH_REQUIRED = authRequired();

// a hand-typed or cut URL may hold a broken %-escape: the id is then taken as it is (the API
// answers capture_not_found) rather than the page stopping on "Loading…"
function decoded(part) {
  try {
    return decodeURIComponent(part);
  } catch {
    return part;
  }
}

function route() {
  const base = new URL(document.baseURI).pathname;
  const path = location.pathname.startsWith(base) ? location.pathname.slice(base.length) : location.pathname.replace(/^\//, "");
  const m = /^captures\/([^/]+)\/?$/.exec(path);
  if (m) return { view: "capture", id: decoded(m[1]) };
  if (path === "stages" || path === "stages/") return { view: "stages" };
  return { view: "captures" };
}

// one dialog for the token: resolves with the token, or null when the user cancels
function tokenDialog() {
  const dialog = document.getElementById("token-dialog");
  const form = document.getElementById("token-form");
  const input = document.getElementById("token-input");
  const error = document.getElementById("token-error");
  let pending = null;
  const finish = (value) => {
    if (dialog.open) dialog.close();
    const p = pending;
    pending = null;
    if (p) p(value);
    renderTokenState();
  };
  form.addEventListener("submit", (evt) => {
    evt.preventDefault();
    const v = input.value.trim();
    if (v) finish(v);
  });
  document.getElementById("token-cancel").addEventListener("click", () => finish(null));
  dialog.addEventListener("cancel", () => finish(null));
  return (reason) =>
    new Promise((resolve) => {
      if (pending) pending(null);
      pending = resolve;
      input.value = "";
      error.hidden = !reason;
      error.textContent = reason || "";
      dialog.showModal();
      input.focus();
    });
}

function renderTokenState() {
  const node = document.getElementById("token-state");
  if (!AUTH_REQUIRED && !token.get()) {
    node.hidden = true;
    return;
  }
  node.hidden = false;
  const has = !!token.get();
  clear(
    node,
    el("span", { class: has ? "dot dot-ok" : "dot dot-warn" }),
    has ? "token set " : "token needed ",
    has
      ? el("button", { class: "link", text: "forget", onclick: () => (token.clear(), renderTokenState()) })
      : null,
  );
}

async function renderUpstream() {
  const node = document.getElementById("upstream");
  try {
    const r = await api("readyz");
    clear(node, el("span", { class: "dot dot-ok" }), `upstream ready · ${r.upstream}`);
    node.title = "upstream healthy and its profiler endpoints mounted";
  } catch (e) {
    const up = e.details && e.details.upstream;
    clear(node, el("span", { class: "dot dot-bad" }), `upstream not ready${up ? " · " + up : ""}`);
    node.title = e.message;
  }
}

async function main() {
  const ask = tokenDialog();
  onTokenNeeded(ask);
  renderTokenState();
  const r = route();
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (a.dataset.nav === (r.view === "capture" ? "captures" : r.view)) a.classList.add("current");
  }
  renderUpstream();
  setInterval(() => !document.hidden && renderUpstream(), 15000);
  startHeartbeats();
  const root = document.getElementById("main");
  if (r.view === "capture") await captureView(root, r.id);
  else if (r.view === "stages") await stagesView(root);
  else await capturesView(root);
}

main();
