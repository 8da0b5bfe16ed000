// One capture: state and timings, per stage the verdict, its reason and what to do, the files
// with download links and "Open in Perfetto", then the summary as charts once it is terminal.
import { api, authRequired, download } from "./api.js";
import { barChart, busyIdleChart, lineChart, stackedChart } from "./charts.js";
import { LIVE, TERMINAL, between, bytes, clear, el, errorBox, seconds, us, when } from "./format.js";
import { stopCapture } from "./leases.js";
import { openInPerfetto } from "./perfetto.js";
import { windowCard } from "./steps.js";
import { VERDICT_HELP, stateBadge, verdictBadge } from "./verdicts.js";

// the capture's `outcome`: the server's one rule for ok (sidecar/control/outcome.py), as the CLI's exit code
const TRACES_TEXT = { ok: "checked, ok", failed: "not ok (see the verdicts)", unchecked: "not checked yet" };

const POLL_MS = 1500;
const TOP_N = 10;
const TRACE_FILE = /(^|\/)(trace_rank\d+\.json(\.gz)?|.*\.pt\.trace\.json(\.gz)?)$/;

// What the server was when the capture started (GET /version and what it serves: sidecar/versions.py).
function serverName(s) {
  const vllm = s.vllm ? `vLLM ${s.vllm}` : "vLLM (version not served)";
  return s.kind === "omni" ? `vLLM-Omni ${s.omni || "(no release for this vLLM)"} on ${vllm}` : vllm;
}

export async function captureView(main, id) {
  const head = el("section", { class: "card", id: "capture-head" });
  const stages = el("section", { class: "card", id: "capture-stages" });
  const summary = el("section", { class: "card", id: "capture-summary" });
  const windowMetrics = el("section", { class: "card", id: "capture-window" });
  clear(main, el("p", { class: "crumbs" }, el("a", { href: "./", text: "Captures" }), " / ", el("span", { class: "mono", text: id })), head, stages, windowMetrics, summary);
  let shownState = null;
  let summaryLoaded = false;
  const stopNotice = el("div", { id: "stop-notice" }); // a failed Stop, kept across the head's re-renders
  const load = async () => {
    let cap;
    try {
      cap = await api(`v1/captures/${encodeURIComponent(id)}`);
    } catch (e) {
      clear(head, errorBox(e));
      return null;
    }
    document.title = `omni-sidecar · ${cap.label || cap.id}`;
    renderHead(head, cap, load, stopNotice);
    // files and buttons only change with the state; re-rendering them would reset Perfetto's status line
    if (cap.state !== shownState || LIVE.has(cap.state)) {
      renderStages(stages, cap);
      windowCard(windowMetrics, cap);
    }
    shownState = cap.state;
    if (TERMINAL.has(cap.state) && !summaryLoaded) {
      summaryLoaded = true;
      loadSummary(summary, cap);
    } else if (!TERMINAL.has(cap.state)) {
      clear(summary, el("h2", { text: "Summary" }), el("p", { class: "muted", text: `The summary comes once the capture is terminal (it is ${cap.state}).` }));
    }
    return cap;
  };
  const tick = async () => {
    const cap = await load();
    if (!cap || !TERMINAL.has(cap.state)) setTimeout(tick, POLL_MS);
  };
  await tick();
}

function fact(name, value) {
  return el("div", { class: "fact" }, el("dt", { text: name }), el("dd", {}, value));
}

function renderHead(card, cap, reload, notice) {
  const live = LIVE.has(cap.state);
  const stop =
    live && cap.state !== "stopping" && cap.state !== "collecting"
      ? el("button", {
          class: "danger",
          id: "stop-button",
          text: "Stop capture",
          onclick: async (e) => {
            e.target.disabled = true;
            clear(notice);
            try {
              await stopCapture(cap.id);
            } catch (err) {
              clear(notice, errorBox(err));
            }
            reload();
          },
        })
      : null;
  const windowLen = between(cap.started_at, cap.stopped_at || (live ? new Date().toISOString() : null));
  const flush = between(cap.stop_requested_at, cap.stopped_at);
  const check = between(cap.stopped_at, cap.finished_at);
  clear(
    card,
    el(
      "div",
      { class: "card-head" },
      // a label is the user's text, in any script: isolated so a right-to-left one reads as written
      el("h2", { class: "cap-title" }, cap.label ? el("bdi", { class: "cap-title-label", text: cap.label }) : "Capture ",
        el("span", { class: "mono muted", text: cap.label ? ` ${cap.id}` : cap.id })),
      el("div", { class: "head-actions" }, stateBadge(cap.state), stop),
    ),
    notice,
    el(
      "dl",
      { class: "facts" },
      fact("Stages", cap.stages.join(", ")),
      fact("Upstream", el("span", { class: "mono", text: cap.upstream })),
      cap.server ? fact("Server", serverName(cap.server)) : null,
      cap.server && cap.server.start_options && Object.keys(cap.server.start_options).length
        ? fact("Start options", el("span", { class: "mono", text: JSON.stringify(cap.server.start_options) })) : null,
      cap.kind ? fact("Kind", cap.kind) : null,
      fact("Created", when(cap.created_at)),
      fact("Started", when(cap.started_at)),
      fact("Window", windowLen === null ? "–" : seconds(windowLen) + (cap.stopped_at ? "" : " so far")),
      fact("Bound", cap.steps ? `after ${cap.steps} engine steps` : cap.duration_s ? `auto-stop after ${seconds(cap.duration_s)}` : cap.lease_s ? `lease ${seconds(cap.lease_s)}` : "until stopped"),
      fact("Stop", cap.stop_reason ? cap.stop_reason.replaceAll("_", " ") : "–"),
      fact("Flush", flush === null ? "–" : seconds(flush)),
      fact("Checked", check === null ? "–" : seconds(check)),
      fact("Traces", TRACES_TEXT[cap.outcome] || "–"),
    ),
    cap.errors && cap.errors.length
      ? el(
          "div",
          { class: "errors" },
          el("h3", { text: "Errors" }),
          el("ul", {}, cap.errors.map((e) => el("li", {}, el("code", { text: e.code }), " ", e.message, el("span", { class: "muted small", text: ` (${when(e.at)})` })))),
        )
      : null,
    // what the sidecar did or saw beside the verdicts: a start held to the next second, files
    // replaced since the verdict
    cap.notes && cap.notes.length
      ? el("div", { class: "notes" }, el("h3", { text: "Notes" }), el("ul", {}, cap.notes.map((n) => el("li", { text: n }))))
      : null,
  );
}

function folderName(session) {
  const p = (session.local_path || session.path).replace(/\/+$/, "");
  return p.slice(p.lastIndexOf("/") + 1);
}

// a name that is not UTF-8 comes with its bytes percent-encoded (name_quoted): that is its URL path
function fileHref(capId, session, f) {
  const path = f.name_quoted || f.name.split("/").map(encodeURIComponent).join("/");
  return `v1/captures/${encodeURIComponent(capId)}/files/${encodeURIComponent(folderName(session))}/${path}`;
}

function renderStages(card, cap) {
  const byStage = new Map((cap.verdicts || []).map((v) => [v.stage_id, v]));
  clear(
    card,
    el("h2", { text: "Stages" }),
    cap.stages.map((sid) => {
      const v = byStage.get(sid) || { stage_id: sid, verdict: null, sessions: [] };
      const verdict = v.verdict || "pending";
      return el(
        "div",
        { class: `stage-block verdict-border-${verdict}`, dataset: { stage: sid } },
        el("div", { class: "stage-head" }, el("h3", { text: `Stage ${sid}` }), verdictBadge(v.verdict)),
        v.reason ? el("p", { class: "reason", text: v.reason }) : null,
        verdict !== "ok" ? el("p", { class: "todo" }, el("strong", { text: "What to do: " }), VERDICT_HELP[verdict] || "") : null,
        v.profiler_dir ? el("p", { class: "muted small" }, "torch_profiler_dir ", el("span", { class: "mono", text: v.profiler_dir })) : null,
        v.sessions.map((s) => sessionTable(cap, sid, s)),
      );
    }),
  );
}

function sessionTable(cap, sid, session) {
  const status = el("span", { class: "perfetto-status muted small", "aria-live": "polite" });
  return el(
    "div",
    { class: "session" },
    el("div", { class: "session-path mono small", title: session.local_path || session.path, text: session.path }),
    !session.files.length ? el("p", { class: "muted small", text: "This session folder holds no file." }) : el("div", { class: "table-wrap" }, el(
      "table",
      { class: "files" },
      el("thead", {}, el("tr", {}, el("th", { text: "File" }), el("th", { class: "num", text: "Size" }), el("th", { text: "" }))),
      el(
        "tbody",
        {},
        session.files.map((f) => {
          const href = fileHref(cap.id, session, f);
          const isTrace = TRACE_FILE.test(f.name) && !f.name_quoted; // Perfetto gets text names only
          const open = isTrace
            ? el("button", {
                class: "small perfetto",
                text: "Open in Perfetto",
                title: "opens ui.perfetto.dev in a new tab and hands it this trace (nothing is uploaded)",
                onclick: () =>
                  openInPerfetto(
                    {
                      captureId: cap.id,
                      stageId: sid,
                      relpath: `${folderName(session)}/${f.name}`,
                      size: f.size,
                      title: `${cap.label || cap.id} · stage ${sid} · ${f.name}`,
                    },
                    { onStatus: (s) => (status.textContent = s) },
                  ),
              })
            : null;
          return el(
            "tr",
            {},
            el("td", { class: "mono file-name" }, f.name),
            el("td", { class: "num", text: bytes(f.size) }),
            el("td", { class: "file-actions" }, downloadLink(href, f.name.split("/").pop(), status), open),
          );
        }),
      ),
    )),
    status,
  );
}

// a plain link; with --token-file a click fetches the file with the token (api.js download)
function downloadLink(href, fileName, status) {
  return el("a", {
    href,
    download: fileName,
    class: "download",
    text: "Download",
    onclick: (evt) => {
      if (!authRequired()) return;
      evt.preventDefault();
      status.textContent = `downloading ${fileName}…`;
      download(href, fileName).then(
        () => (status.textContent = ""),
        (e) => (status.textContent = "could not download the file: " + e.message),
      );
    },
  });
}

async function loadSummary(card, cap) {
  clear(card, el("h2", { text: "Summary" }), el("p", { class: "muted", text: "Reading the traces… (large traces take a while the first time; the result is cached)" }));
  let s;
  try {
    s = await api(`v1/captures/${encodeURIComponent(cap.id)}/summary`);
  } catch (e) {
    clear(card, el("h2", { text: "Summary" }), errorBox(e));
    return;
  }
  renderSummary(card, s);
}

function totalsLine(body) {
  const t = body.totals || {};
  const w = body.window || {};
  const parts = [
    `window ${us(w.span_us)}`,
    `${(t.events || 0).toLocaleString()} events`,
    `${(t.cpu_ops || 0).toLocaleString()} CPU ops (${us(t.cpu_op_self_us)} self)`,
  ];
  if (t.kernels) parts.push(`${t.kernels.toLocaleString()} kernels (${us(t.kernel_us)})`);
  if (t.memcpy_us) parts.push(`memcpy ${us(t.memcpy_us)}`);
  if (w.engine_steps) parts.push(`${w.engine_steps} engine steps`);
  return el("p", { class: "totals muted", text: parts.join(" · ") });
}

// Which process a device belongs to: every stage process calls its GPU cuda:0, so the stage (and
// the replica and rank where the summary knows them) is what tells two devices apart. Worded as
// the findings word a place (sidecar/analysis/findings.py, _where): "stage 1 · rank 0 · cuda:0".
function deviceLabel(d, device) {
  const parts = [d.stage_id === null || d.stage_id === undefined ? "unknown stage" : `stage ${d.stage_id}`];
  if (d.replica !== null && d.replica !== undefined) parts.push(`replica ${d.replica}`);
  if (d.rank !== null && d.rank !== undefined) parts.push(`rank ${d.rank}`);
  parts.push(device);
  return parts.join(" · ");
}

// the summary's `devices` are GPUs (kernel and memcpy events), torch's "cuda" on NVIDIA and ROCm alike
const gpuLabel = (d) => deviceLabel(d, `cuda:${d.device}`);

function deviceRows(devices) {
  return (devices || []).map((d) => ({
    label: gpuLabel(d),
    idle_share: d.idle_share,
    busyText: us(d.busy_us),
  }));
}

function stepRows(s) {
  const rows = [];
  for (const st of s.stages || []) {
    const w = st.window || {};
    const name = st.stage_id === null || st.stage_id === undefined ? "unknown stage" : `stage ${st.stage_id}`;
    if (w.engine_step_mean_us) rows.push({ label: `${name} · engine step`, value: w.engine_step_mean_us, note: `mean of ${w.engine_steps}` });
    if (w.step_mean_us) rows.push({ label: `${name} · ProfilerStep`, value: w.step_mean_us, note: `mean of ${w.steps}` });
  }
  return rows;
}

const TEMPORAL = [
  { key: "compute_share", name: "compute", cls: "seg-compute" },
  { key: "communication_share", name: "communication", cls: "seg-comm" },
  { key: "memory_share", name: "memory", cls: "seg-memory" },
  { key: "other_share", name: "other", cls: "seg-other" },
  { key: "idle_share", name: "idle", cls: "seg-idle" },
];
const IDLE = [
  { key: "host_wait_share", name: "host wait", cls: "seg-host" },
  { key: "kernel_wait_share", name: "kernel wait", cls: "seg-kernelwait" },
  { key: "other_share", name: "other", cls: "seg-elsewhere" },
];

// the summary's ranked findings (sidecar/analysis/findings.py words them), shown first
function findingsList(findings) {
  if (!findings || !findings.length) return null;
  return el(
    "ol",
    { class: "summary-findings" },
    findings.map((f) => el("li", { class: `sev-${f.severity}`, dataset: { rule: f.rule } }, el("span", { class: "sev", text: f.severity }), " ", f.message)),
  );
}

function whyCharts(devices) {
  const rows = (devices || []).filter((d) => d.temporal);
  if (!rows.length) return [];
  return [
    stackedChart("Where the steady window went", rows.map((d) => ({ label: gpuLabel(d), shares: d.temporal })), TEMPORAL),
    stackedChart("Why the GPU was idle", rows.filter((d) => d.idle_breakdown).map((d) => ({ label: gpuLabel(d), shares: d.idle_breakdown })), IDLE),
  ].filter(Boolean);
}

// what held memory (the summary's `memory`, from torch's memory events): allocated (solid, its
// peak marked) and reserved (dashed) over the window, one colour per device; then what was live
// at each device's peak, by the op that allocated it
function memoryLabel(m) {
  return deviceLabel(m, m.device >= 0 ? `${m.device_type}:${m.device}` : m.device_type);
}

function memoryCharts(memory) {
  const rows = (memory || []).filter((m) => m.series && m.series.length);
  if (!rows.length) return [];
  const series = rows.flatMap((m, i) => {
    const cls = `line-${i % 4}`;
    const out = [{ label: `${memoryLabel(m)} allocated`, cls, points: m.series.map((p) => [p[0], p[1]]) }];
    if (m.series.some((p) => p[2] > 0)) out.push({ label: `${memoryLabel(m)} reserved`, cls, dashed: true, points: m.series.map((p) => [p[0], p[2]]) });
    return out;
  });
  const peaks = rows.map((m) => `${memoryLabel(m)}: peak ${bytes(m.peak_allocated_bytes)}` + (m.peak_offset_us !== null && m.peak_offset_us !== undefined ? ` at ${us(m.peak_offset_us)}` : "") + (m.free_at_peak_share !== null && m.free_at_peak_share !== undefined ? `, ${Math.round(m.free_at_peak_share * 100)} % of reserved free` : ""));
  return [
    lineChart("Memory over the window", series, { xFmt: us, yFmt: bytes, note: peaks.join(" · ") }),
    ...rows.map((m) => barChart(`Live at the peak by op (${memoryLabel(m)})`, (m.live_at_peak || []).map((o) => ({ label: o.name, value: o.bytes, note: `${o.blocks} block(s)${o.stack && o.stack.length ? " · " + o.stack.join(" › ") : ""}` })), { fmt: bytes, cls: "bar-kernel" })),
  ].filter(Boolean);
}

export function renderSummary(card, s) {
  const charts = [];
  const notes = [];
  if (s.truncated) notes.push(el("p", { class: "warn-text", text: "A trace ended early: the numbers cover the events read before that." }));
  for (const e of s.errors || []) notes.push(el("p", { class: "warn-text", text: e }));
  const steps = barChart("Engine step time (mean)", stepRows(s), { fmt: us, cls: "bar-step" });
  const devices = busyIdleChart("Busy vs idle per device (whole capture)", deviceRows(s.devices));
  const overall = el("div", { class: "chart-grid" }, steps, devices);
  const stages = (s.stages || []).map((st) => {
    const name = st.stage_id === null || st.stage_id === undefined ? "Files of an unknown stage" : `Stage ${st.stage_id}`;
    const top = (rows, key) => [...rows].sort((a, b) => b[key] - a[key]).slice(0, TOP_N);
    const figs = [
      ...whyCharts(st.devices),
      ...memoryCharts(st.memory),
      barChart("Top ops by self CPU time", top(st.cpu_ops || [], "self_us").map((o) => ({ label: o.name, value: o.self_us, note: `${o.count}×` })), { fmt: us, cls: "bar-cpu" }),
      barChart("Top ops by self device time", top(st.cpu_ops_by_device || [], "self_device_us").map((o) => ({ label: o.name, value: o.self_device_us, note: `${o.count}×` })), { fmt: us, cls: "bar-gpu" }),
      barChart("Top kernels by GPU time", top(st.kernels || [], "total_us").map((k) => ({ label: k.name, value: k.total_us, note: `${k.count}×` })), { fmt: us, cls: "bar-kernel" }),
      barChart("Annotations (self time)", top(st.annotations || [], "self_us").map((o) => ({ label: o.name, value: o.self_us, note: `${o.count}×` })), { fmt: us, cls: "bar-ann" }),
      busyIdleChart("Busy vs idle per device", deviceRows(st.devices)),
    ].filter(Boolean);
    charts.push(...figs);
    return el(
      "div",
      { class: "summary-stage", dataset: { stage: st.stage_id ?? "" } },
      el("h3", { text: name }),
      totalsLine(st),
      figs.length ? el("div", { class: "chart-grid" }, figs) : el("p", { class: "muted", text: "No events in this stage's traces." }),
    );
  });
  clear(
    card,
    el("h2", { text: "Summary" }),
    findingsList(s.findings),  // right under the window's server metrics card (steps.js windowCard)
    totalsLine(s),
    notes,
    steps || devices ? overall : null,
    stages,
    !stages.length && !steps && !devices ? el("p", { class: "muted", text: "The traces hold nothing to chart." }) : null,
  );
}
