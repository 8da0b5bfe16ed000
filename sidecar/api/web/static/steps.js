// Windows counted in engine steps and the server's metrics over a window (docs/captures.md):
// the start form's "for N engine steps" mode with the latest plan's prediction, and a capture's
// steps (asked, counted, in each trace) and window metrics table.
import { api } from "./api.js";
import { el } from "./format.js";

// " (0.37-1.84 in its probes)": the least and most the probes of the server's whole window gave
const span = (range, unit) => (range ? ` (${range[0].toFixed(2)}-${range[1].toFixed(2)}${unit} in its probes)` : "");

// The start form's steps mode: an input and a line that shows the latest plan's prediction.
export function stepsMode() {
  const input = el("input", { type: "number", name: "steps", min: "1", step: "1", value: "20", class: "num", id: "steps-input", "aria-label": "engine steps" });
  const prediction = el("span", { class: "muted small", id: "steps-prediction" });
  let seq = 0;
  const predict = async () => {
    const mine = ++seq;
    const n = Number(input.value);
    if (!Number.isInteger(n) || n < 1) {
      prediction.textContent = "";
      return;
    }
    try {
      const r = await api(`v1/plan?steps=${n}`);
      if (mine !== seq) return;
      prediction.textContent = r.prediction
        ? ` predicted ${r.prediction.mb.toFixed(1)} MB${span(r.prediction.mb_range, "")}, stop ${r.prediction.stop_s.toFixed(1)} s${span(r.prediction.stop_range_s, " s")} (plan of stages ${r.plan.stages.join(", ")})`
        : " no plan yet: `omni-sidecar plan` predicts the size";
    } catch {
      prediction.textContent = "";
    }
  };
  input.addEventListener("input", predict);
  predict();
  // a server with no max_iterations cap on these stages refuses a steps window unless it is counted
  const count = el("input", { type: "checkbox", name: "count_steps", id: "count-steps" });
  const counted = el("label", { class: "small", title: "the sidecar counts the server's /metrics and stops at N: best effort, the traces hold more (the server's own cap, `omni-sidecar render --steps N`, is exact)" }, count, " count them (best effort)");
  return { input, count, content: ["for ", input, " engine steps ", counted, prediction] };
}

function ms(v) {
  return v === null || v === undefined ? "" : (v * 1000).toFixed(1);
}

function latencyCell(h) {
  return h && h.count ? `${ms(h.p50_s)} / ${ms(h.p95_s)}` : "";
}

// A capture's steps line (steps windows only) and its window metrics table.
export function windowCard(card, cap) {
  card.replaceChildren(el("h2", { text: "Server metrics over the window" }));
  if (cap.steps) {
    const traced = (cap.verdicts || []).filter((v) => v.steps_traced !== null && v.steps_traced !== undefined);
    card.append(
      el(
        "p",
        { id: "steps-line" },
        `Steps: ${cap.steps} asked, ${cap.steps_counted ?? "?"} counted by the server`,
        cap.steps_bound ? ` (ended by ${cap.steps_bound === "count" ? "the sidecar's count" : "the server's cap"}${cap.steps_ended_by && cap.steps_ended_by !== "steps" && cap.steps_ended_by !== "server" ? `, ${cap.steps_ended_by.replace("_", " ")}` : ""})` : "",
        traced.length ? `; in the traces: ${traced.map((v) => `stage ${v.stage_id}: ${v.steps_traced}`).join(", ")}` : "",
      ),
    );
  }
  const wm = cap.window_metrics;
  if (!wm) {
    card.append(el("p", { class: "muted", text: "Not recorded for this capture (its metrics come once it is terminal)." }));
    return;
  }
  if (wm.unavailable) {
    card.append(el("p", { class: "muted", id: "window-unavailable", text: `None: ${wm.unavailable}` }));
    return;
  }
  const cols = ["engine", "steps", "requests", "prompt tok", "gen tok", "ttft p50/p95 ms", "itl p50/p95 ms", "e2e p50/p95 ms", "queue p50/p95 ms"];
  const rows = wm.engines.map((e) =>
    el(
      "tr",
      {},
      el("td", { text: e.stage !== null ? `stage ${e.stage}${e.replica && e.replica !== "0" ? ` rep ${e.replica}` : ""}` : `engine ${e.engine}` }),
      [e.engine_steps, e.requests_finished, e.prompt_tokens, e.generation_tokens].map((v) => el("td", { class: "num", text: v ?? "" })),
      ["ttft", "itl", "e2e", "queue"].map((k) => el("td", { class: "num", text: latencyCell(e.latency[k]) })),
    ),
  );
  card.append(
    el("p", { class: "muted small", text: `${(wm.seconds ?? 0).toFixed(1)} s between the scrapes of the server's /metrics` }),
    el("div", { class: "table-wrap" }, el("table", { class: "table", id: "window-metrics" }, el("thead", {}, el("tr", {}, cols.map((c) => el("th", { text: c })))), el("tbody", {}, rows))),
  );
}
