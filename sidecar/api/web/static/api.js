// The page's one way to call the sidecar's JSON API. Mutating calls are JSON-only POSTs
// (content-type application/json: a cross-site form cannot send one, so CSRF needs no cookie
// trick), the bearer token goes in Authorization on every call once the tab has it, and a 401
// asks for the token, then retries. With --token-file the reads of trace content (the summary,
// the timeline, file downloads) need it too, not only starts and stops.

const TOKEN_KEY = "omni-sidecar.token";

export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details || {};
  }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

// why: the server's own words ({"error": {"code", "message", "details"}}), else the status line
async function errorOf(res) {
  let body = null;
  try {
    body = await res.json();
  } catch {
    /* not JSON: a proxy's page, say */
  }
  const err = body && body.error;
  if (err && err.message) return new ApiError(res.status, err.code, err.message, err.details);
  return new ApiError(res.status, "http_" + res.status, `${res.status} ${res.statusText || "error"}`, {});
}

let askToken = async () => null; // replaced by the page (a dialog); null = the user cancelled
export function onTokenNeeded(fn) {
  askToken = fn;
}

// api(path, {method, body, raw}) → parsed JSON (or the Response with raw: true); throws ApiError
export async function api(path, { method = "GET", body, raw = false, signal } = {}) {
  let reason = null;
  for (let attempt = 0; attempt < 4; attempt++) {
    const headers = { Accept: raw ? "*/*" : "application/json" };
    const tok = token.get();
    if (tok) headers.Authorization = `Bearer ${tok}`;
    const init = { method, headers, credentials: "same-origin", cache: "no-store", signal };
    if (method !== "GET" && method !== "HEAD") {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body ?? {});
    }
    let res;
    try {
      res = await fetch(path, init);
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(0, "sidecar_unreachable", "the sidecar does not answer (is `omni-sidecar serve` running?)", {});
    }
    if (res.status === 401) {
      const err = await errorOf(res);
      reason = tok ? "That token was rejected: " + err.message : err.message;
      const given = await askToken(reason);
      if (!given) throw err;
      token.set(given);
      continue;
    }
    if (!res.ok) throw await errorOf(res);
    if (raw) return res;
    if (res.status === 204) return null;
    return res.json();
  }
  throw new ApiError(401, "unauthorized", reason || "unauthorized", {});
}

// whether this sidecar runs with --token-file (the shell says so in <body data-auth>)
export const authRequired = () => document.body.dataset.auth === "required";

// Saves one of the capture's files, as its Download link would. A link cannot send the bearer
// token, so where the sidecar wants one the file is fetched with it (asking for it first if the
// tab has none) and handed to the browser as a blob; otherwise the link downloads by itself.
export async function download(path, fileName) {
  const res = await api(path, { raw: true });
  const url = URL.createObjectURL(await res.blob());
  const link = document.createElement("a");
  link.href = url;
  link.download = fileName;
  link.hidden = true;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000); // the browser has started the download by then
}

// the capture list, newest first, one page at a time. The server pages when it knows
// `?limit=&before=` (a reply no longer than `limit`); an older server returns everything, and
// the page is cut here.
export async function listCaptures({ limit, before }) {
  const q = new URLSearchParams({ limit: String(limit) });
  if (before) q.set("before", before);
  const res = await api(`v1/captures?${q}`, { raw: true });
  const body = await res.json();
  const all = Array.isArray(body) ? body : body.captures || [];
  // a server that ignores the paging query returns more than asked, or the `before` capture itself
  if (all.length > limit || (before && all.some((c) => c.id === before))) {
    // client-side paging over the whole list
    const start = before ? all.findIndex((c) => c.id === before) + 1 : 0;
    const page = all.slice(start, start + limit);
    const more = start + limit < all.length;
    return { captures: page, next: more ? page[page.length - 1].id : null, total: all.length };
  }
  const next =
    body.next_before ?? body.next ?? res.headers.get("X-Next-Before") ?? nextFromLink(res.headers.get("Link")) ??
    (all.length === limit ? all[all.length - 1].id : null);
  return { captures: all, next: next || null, total: body.total ?? null };
}

function nextFromLink(link) {
  if (!link) return null;
  const m = /<([^>]*)>\s*;\s*rel="?next"?/.exec(link);
  if (!m) return null;
  return new URL(m[1], document.baseURI).searchParams.get("before");
}
