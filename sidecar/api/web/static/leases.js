// Captures started from this tab with a lease stay alive while the tab is open: the page sends
// POST /v1/captures/{id}/heartbeat every third of the lease. Close the tab and the sidecar stops
// the capture when the lease runs out.
import { api } from "./api.js";

const KEY = "omni-sidecar.leases";

function load() {
  try {
    return JSON.parse(sessionStorage.getItem(KEY) || "{}");
  } catch {
    return {};
  }
}

function save(leases) {
  sessionStorage.setItem(KEY, JSON.stringify(leases));
}

export function keepAlive(cap) {
  const leases = load();
  leases[cap.id] = { lease_s: cap.lease_s, last: Date.now() };
  save(leases);
}

export function release(id) {
  const leases = load();
  delete leases[id];
  save(leases);
}

export async function stopCapture(id) {
  release(id);
  return api(`v1/captures/${encodeURIComponent(id)}/stop`, { method: "POST" });
}

export function startHeartbeats() {
  const tick = async () => {
    const leases = load();
    for (const [id, l] of Object.entries(leases)) {
      if (Date.now() - l.last < (l.lease_s * 1000) / 3) continue;
      try {
        const cap = await api(`v1/captures/${encodeURIComponent(id)}/heartbeat`, { method: "POST" });
        if (cap.state !== "active" && cap.state !== "starting") release(id);
        else keepAlive(cap);
      } catch (e) {
        if (e.status === 404 || e.status === 409) release(id);
      }
    }
  };
  setInterval(tick, 1000);
}
