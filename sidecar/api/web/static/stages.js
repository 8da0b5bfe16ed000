// The stages page: the deploy's stages as the sidecar read them (GET /v1/stages), each with its
// effective profiler_config and the validation findings, errors first.
import { api } from "./api.js";
import { clear, el, errorBox } from "./format.js";

const PROTON = /^proton_/;
const SEVERITY_ORDER = { error: 0, warning: 1, info: 2 };

function where(f) {
  const w = f.where;
  if (!w || !w.file) return null;
  return `${w.file}${w.line ? ":" + w.line : ""}${w.column ? ":" + w.column : ""}`;
}

function findingList(findings) {
  if (!findings.length) return el("p", { class: "ok-text small", text: "No findings." });
  const sorted = [...findings].sort((a, b) => (SEVERITY_ORDER[a.severity] ?? 9) - (SEVERITY_ORDER[b.severity] ?? 9));
  return el(
    "ul",
    { class: "findings" },
    sorted.map((f) =>
      el(
        "li",
        { class: `finding-item sev-${f.severity}` },
        el("span", { class: `badge finding-${f.severity}`, text: f.severity }),
        " ",
        el("code", { text: f.code }),
        " ",
        el("span", { class: "finding-message", text: f.message }),
        f.key || where(f) ? el("div", { class: "muted small mono", text: [f.key, where(f)].filter(Boolean).join(" · ") }) : null,
      ),
    ),
  );
}

function configTable(cfg) {
  if (!cfg) return el("p", { class: "muted", text: "No profiler_config: this stage cannot be profiled." });
  const keys = Object.keys(cfg).filter((k) => cfg.profiler === "proton" || !PROTON.test(k));
  return el(
    "table",
    { class: "config" },
    el(
      "tbody",
      {},
      keys.map((k) => el("tr", {}, el("td", { class: "mono key", text: k }), el("td", { class: "mono", text: cfg[k] === null ? "null" : JSON.stringify(cfg[k]) }))),
    ),
  );
}

export async function stagesView(main) {
  const card = el("section", { class: "card", id: "stages-card" });
  clear(main, card);
  let r;
  try {
    r = await api("v1/stages");
  } catch (e) {
    clear(card, errorBox(e));
    return;
  }
  const global = (r.findings || []).filter((f) => f.stage_id === null || f.stage_id === undefined);
  clear(
    card,
    el("div", { class: "card-head" }, el("h2", { text: "Stages" }), el("span", { class: "muted mono small", text: r.deploy_config || "" })),
    el("p", { class: "muted small", text: `platform ${r.platform || "–"} · ${r.stages.length} stage${r.stages.length === 1 ? "" : "s"}` }),
    r.server ? el("p", { class: "small", id: "server-line" }, "Server ", el("span", { class: "mono", text: r.server.summary })) : null,
    r.server && r.server.warnings && r.server.warnings.length
      ? el("ul", { class: "findings", id: "server-warnings" }, r.server.warnings.map((w) => el("li", { class: "finding-item sev-warning" }, el("code", { text: w.code }), " ", w.fix || w.version || w.assumed || "")))
      : null,
    global.length ? el("div", { class: "stage-block" }, el("h3", { text: "Deploy" }), findingList(global)) : null,
    r.stages.map((s) =>
      el(
        "div",
        { class: "stage-block", dataset: { stage: s.stage_id } },
        el(
          "div",
          { class: "stage-head" },
          el("h3", { text: `Stage ${s.stage_id}` }),
          el("span", { class: "tag", text: s.kind }),
          el("span", { class: s.profiler ? "badge verdict-ok" : "badge verdict-unverified", text: s.profiler || "no profiler" }),
          s.num_replicas > 1 ? el("span", { class: "tag", text: `${s.num_replicas} replicas` }) : null,
        ),
        s.profiler_dir ? el("p", { class: "small" }, "torch_profiler_dir ", el("span", { class: "mono", text: s.profiler_dir })) : null,
        el("div", { class: "stage-cols" }, el("div", {}, el("h4", { text: "Effective profiler_config" }), configTable(s.profiler_config)), el("div", {}, el("h4", { text: "Findings" }), findingList(s.findings || []))),
      ),
    ),
  );
}
