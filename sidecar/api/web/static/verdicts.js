// Verdict and state badges, and what a user can do about each verdict (docs/design.md §5).
import { el } from "./format.js";

export const VERDICT_HELP = {
  ok: "A trace was written and is not empty: open it in Perfetto or download it.",
  empty:
    "Traces were written but record no op and no kernel: no request reached this stage while it " +
    "recorded. Send requests while the capture is active; check delay_iterations / max_iterations.",
  missing:
    "No new session folder for this stage. Check that the running server really profiles it " +
    "(--stage-overrides and --profiler-config win over the YAML), that its worker is alive, and " +
    "raise OMNI_SIDECAR_COLLECT_TIMEOUT_S if the flush is slow.",
  partial:
    "Fewer traces than replicas × ranks: the reason names the lost replica or rank. LLM replicas of one " +
    "server overwrite each other's trace (vLLM-Omni 0.30): run one replica per server, each with its own " +
    "torch_profiler_dir; a lost rank or replica: read its log.",
  unverified:
    "The sidecar cannot see this stage's folder. Run it on the server's host, or map the folder " +
    "with --artifact-root SERVER_PATH=LOCAL_PATH.",
  ambiguous:
    "The trace folder cannot be told apart from another server's (they share a torch_profiler_dir). " +
    "Give each server and replica its own torch_profiler_dir.",
  pending: "The verdict comes once the stop has flushed and the folders were checked.",
};

export function verdictBadge(verdict, stageId) {
  const v = verdict || "pending";
  return el("span", {
    class: `badge verdict verdict-${v}`,
    title: stageId === undefined ? VERDICT_HELP[v] || v : `stage ${stageId}: ${v}`,
    dataset: { verdict: v, stage: stageId === undefined ? "" : String(stageId) },
  }, stageId === undefined ? v : [el("span", { class: "badge-stage", text: String(stageId) }), v]);
}

export function stateBadge(state) {
  return el("span", { class: `badge state state-${state}`, dataset: { state }, text: state });
}
