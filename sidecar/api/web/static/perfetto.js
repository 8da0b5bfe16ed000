// "Open in Perfetto": Perfetto's documented deep-link protocol
// (https://perfetto.dev/docs/visualization/deep-linking-to-perfetto-ui): open ui.perfetto.dev in
// a new tab, PING it until it answers PONG, then post {perfetto: {buffer, title, fileName}}. The
// trace goes from this tab to that tab in the browser; it is not uploaded anywhere.
import { api } from "./api.js";

export const PERFETTO_ORIGIN = "https://ui.perfetto.dev";
// above this (compressed) size the raw trace is slow for Perfetto's in-browser JSON import: use
// the sidecar's slim timeline when it has one
export const SLIM_ABOVE_BYTES = 64 * 1024 * 1024;
const PONG_TIMEOUT_MS = 60000;

// → {buffer, fileName, slim}: the slim timeline when the file is big and the sidecar has one
async function traceBytes({ captureId, stageId, relpath, size }, onStatus) {
  if (size > SLIM_ABOVE_BYTES) {
    try {
      onStatus("asking the sidecar for a slim timeline…");
      const res = await api(`v1/captures/${encodeURIComponent(captureId)}/timeline?stage=${stageId}`, { raw: true });
      const name = /filename="?([^";]+)"?/.exec(res.headers.get("Content-Disposition") || "");
      return { buffer: await res.arrayBuffer(), fileName: name ? name[1] : `${captureId}-stage${stageId}-timeline.json`, slim: true };
    } catch (e) {
      if (e.status !== 404 && e.status !== 405) throw e;
      onStatus("no slim timeline on this sidecar: sending the whole trace (this can take a while)");
    }
  }
  const res = await api(`v1/captures/${encodeURIComponent(captureId)}/files/${relpath.split("/").map(encodeURIComponent).join("/")}`, { raw: true });
  return { buffer: await res.arrayBuffer(), fileName: relpath.split("/").pop(), slim: false };
}

// must run inside the click handler: a popup opened later (after an await) is blocked
export function openInPerfetto(trace, { onStatus = () => {} } = {}) {
  const win = window.open(PERFETTO_ORIGIN, "_blank");
  if (!win) {
    onStatus("the browser blocked the new tab: allow pop-ups for this page, or download the trace and open it at ui.perfetto.dev");
    return Promise.resolve(false);
  }
  return new Promise((resolve) => {
    let payload = null;
    let ponged = false;
    const started = Date.now();
    const send = () => {
      win.postMessage(
        { perfetto: { buffer: payload.buffer, title: trace.title, fileName: payload.fileName } },
        PERFETTO_ORIGIN,
      );
      onStatus(`sent ${payload.slim ? "the slim timeline" : "the trace"} to Perfetto (${(payload.buffer.byteLength / 1048576).toFixed(1)} MiB)`);
      resolve(true);
    };
    const onMessage = (evt) => {
      if (evt.source !== win || evt.data !== "PONG") return;
      ponged = true;
      clearInterval(timer);
      window.removeEventListener("message", onMessage);
      if (payload) send();
    };
    window.addEventListener("message", onMessage);
    const timer = setInterval(() => {
      if (win.closed || Date.now() - started > PONG_TIMEOUT_MS) {
        clearInterval(timer);
        window.removeEventListener("message", onMessage);
        onStatus(win.closed ? "the Perfetto tab was closed" : "Perfetto did not answer; download the trace and open it there");
        resolve(false);
        return;
      }
      win.postMessage("PING", PERFETTO_ORIGIN);
    }, 50);
    onStatus("fetching the trace…");
    traceBytes(trace, onStatus).then(
      (p) => {
        payload = p;
        onStatus("waiting for Perfetto to load…");
        if (ponged) send();
      },
      (e) => {
        clearInterval(timer);
        window.removeEventListener("message", onMessage);
        onStatus("could not read the trace: " + e.message);
        resolve(false);
      },
    );
  });
}
