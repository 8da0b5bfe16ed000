// The captures page: a form that starts a capture (stages from GET /v1/stages) and the list,
// newest first, paged, refreshed while any capture on the page is live.
import { api, listCaptures } from "./api.js";
import { LIVE, between, clear, el, errorBox, seconds, when } from "./format.js";
import { keepAlive, stopCapture } from "./leases.js";
import { stepsMode } from "./steps.js";
import { stateBadge, verdictBadge } from "./verdicts.js";

// `/?limit=N` picks the page size (1-200); 20 by default
const PAGE_SIZE = Math.min(200, Math.max(1, Number(new URLSearchParams(location.search).get("limit")) || 20));
const POLL_LIVE_MS = 1500;
const POLL_IDLE_MS = 5000;

export async function capturesView(main) {
  const formCard = el("section", { class: "card", id: "start-card" });
  const listCard = el("section", { class: "card", id: "list-card" });
  clear(main, formCard, listCard);
  const list = new CaptureList(listCard);
  await Promise.all([startForm(formCard, () => list.refresh()), list.refresh()]);
  list.poll();
}

async function startForm(card, onStarted) {
  card.append(el("h2", { text: "New capture" }));
  let report;
  try {
    report = await api("v1/stages");
  } catch (e) {
    card.append(errorBox(e));
    return;
  }
  const result = el("div", { id: "start-result", "aria-live": "polite" });
  const stageBoxes = report.stages.map((s) => {
    const profiled = !!s.profiler;
    const box = el("input", { type: "checkbox", name: "stage", value: s.stage_id, checked: s.profiler === "torch" });
    const errors = (s.findings || []).filter((f) => f.severity === "error").length;
    return el(
      "label",
      { class: "stage-pick" + (profiled ? "" : " unprofiled"), title: profiled ? s.profiler_dir || "" : "this stage has no profiler_config" },
      box,
      el("span", { class: "stage-name", text: `stage ${s.stage_id}` }),
      el("span", { class: "stage-kind", text: profiled ? s.profiler : "no profiler" }),
      errors ? el("span", { class: "badge finding-error", text: `${errors} error${errors > 1 ? "s" : ""}` }) : null,
    );
  });
  // a mode's own field (duration, lease, steps, "count them") picks that mode when it is clicked or
  // changed: typing a duration must not leave the capture running until stopped
  const mode = (value, ...content) => {
    const radio = el("input", { type: "radio", name: "mode", value, checked: value === "manual" });
    const pick = (evt) => {
      if (evt.target !== radio && evt.target.tagName === "INPUT") radio.checked = true;
    };
    return el("label", { class: "mode", oninput: pick, onchange: pick, onclick: pick }, radio, ...content);
  };
  const duration = el("input", { type: "number", name: "duration_s", min: "0.1", step: "any", value: "10", class: "num", "aria-label": "duration in seconds" });
  const lease = el("input", { type: "number", name: "lease_s", min: "1", step: "any", value: "60", class: "num", "aria-label": "lease in seconds" });
  const steps = stepsMode();
  const label = el("input", { type: "text", name: "label", maxlength: "200", placeholder: "e.g. step 3, long prompts", class: "label-input" });
  const submit = el("button", { type: "submit", id: "start-button", text: "Start capture" });
  const form = el(
    "form",
    { id: "start-form", novalidate: true },
    el("div", { class: "field" }, el("span", { class: "field-name", text: "Stages" }), el("div", { class: "stage-picks" }, stageBoxes)),
    el(
      "div",
      { class: "field" },
      el("span", { class: "field-name", text: "Window" }),
      el(
        "div",
        { class: "modes" },
        mode("manual", "until I stop it"),
        mode("duration", "for ", duration, " s"),
        mode("lease", "while this page is open, lease ", lease, " s"),
        mode("steps", ...steps.content),
      ),
    ),
    el("div", { class: "field" }, el("span", { class: "field-name", text: "Label" }), label),
    el("div", { class: "field" }, el("span", { class: "field-name" }), el("div", {}, submit)),
  );
  form.addEventListener("submit", async (evt) => {
    evt.preventDefault();
    const body = {
      stages: [...form.querySelectorAll("input[name=stage]:checked")].map((b) => Number(b.value)),
    };
    const m = form.querySelector("input[name=mode]:checked").value;
    if (m === "duration") body.duration_s = Number(duration.value);
    if (m === "lease") body.lease_s = Number(lease.value);
    if (m === "steps") {
      body.steps = Number(steps.input.value);
      if (steps.count.checked) body.steps_bound = "count";
    }
    if (label.value.trim()) body.label = label.value.trim();
    submit.disabled = true;
    clear(result, el("p", { class: "muted", text: "starting… (the server answers once every stage has started)" }));
    try {
      const cap = await api("v1/captures", { method: "POST", body });
      if (cap.lease_s) keepAlive(cap);
      clear(result, el("p", { class: "ok-text" }, "Started ", el("a", { href: `captures/${cap.id}`, text: cap.id }), "."));
      onStarted();
    } catch (e) {
      const extra =
        e.code === "capture_active" && e.details.active_id
          ? el("div", {}, "Active capture: ", el("a", { href: `captures/${e.details.active_id}`, text: e.details.active_id }))
          : null;
      clear(result, errorBox(e, extra));
    } finally {
      submit.disabled = false;
    }
  });
  card.append(form, result);
  if (!report.stages.some((s) => s.profiler)) {
    card.append(el("p", { class: "warn-text", text: "No stage of this deploy has a profiler_config: see the Stages page." }));
  }
}

class CaptureList {
  constructor(card) {
    this.card = card;
    this.cursors = [null]; // the `before` of each page seen so far; the last is the current page
    this.page = null;
    this.asked = 0; // refreshes asked for so far
    this.timer = null;
    this.body = el("tbody", { id: "captures-body" });
    this.pager = el("div", { class: "pager" });
    this.notice = el("div", { id: "list-notice" });
    this.stopNotice = el("div", { id: "stop-notice" }); // a failed Stop: kept until the next Stop, not wiped by the refresh
    card.append(
      el("div", { class: "card-head" }, el("h2", { text: "Captures" }), el("span", { class: "muted", id: "list-meta" })),
      this.notice,
      this.stopNotice,
      el(
        "div",
        { class: "table-wrap" },
        el(
          "table",
          { class: "captures", id: "captures" },
          el("thead", {}, el("tr", {}, ["Capture", "State", "Stages", "Window", "Verdicts", ""].map((h) => el("th", { text: h })))),
          this.body,
        ),
      ),
      this.pager,
    );
  }

  async refresh() {
    // Refreshes overlap (the timer's, a click's): only the last one asked for is drawn, so a slow
    // answer for the page before "Older" is not drawn over the page it went to.
    const asked = ++this.asked;
    let page;
    try {
      page = await listCaptures({ limit: PAGE_SIZE, before: this.cursors[this.cursors.length - 1] });
    } catch (e) {
      if (asked === this.asked) clear(this.notice, errorBox(e));
      return;
    }
    if (asked !== this.asked) return;
    this.page = page;
    clear(this.notice);
    this.render();
  }

  poll() {
    clearTimeout(this.timer);
    const live = this.page && this.page.captures.some((c) => LIVE.has(c.state));
    this.timer = setTimeout(async () => {
      if (!document.hidden) await this.refresh();
      this.poll();
    }, live ? POLL_LIVE_MS : POLL_IDLE_MS);
  }

  render() {
    const caps = this.page.captures;
    const meta = this.card.querySelector("#list-meta");
    meta.textContent = this.page.total !== null ? `${this.page.total} in all` : "";
    if (!caps.length) {
      clear(this.body, el("tr", {}, el("td", { colspan: 6, class: "empty", text: "No captures yet. Start one above, or with `omni-sidecar capture`." })));
    } else {
      clear(this.body, caps.map((c) => this.row(c)));
    }
    const newer = el("button", { class: "secondary", text: "← Newer", disabled: this.cursors.length === 1 });
    const older = el("button", { class: "secondary", text: "Older →", disabled: !this.page.next });
    newer.addEventListener("click", () => {
      this.cursors.pop();
      this.refresh();
    });
    older.addEventListener("click", () => {
      this.cursors.push(this.page.next);
      this.refresh();
    });
    clear(this.pager, newer, el("span", { class: "muted", text: `page ${this.cursors.length}` }), older);
  }

  row(c) {
    const verdicts = c.stages.map((sid) => {
      const v = (c.verdicts || []).find((x) => x.stage_id === sid);
      return verdictBadge(v && v.verdict, sid);
    });
    const stop = LIVE.has(c.state) && c.state !== "stopping" && c.state !== "collecting"
      ? el("button", { class: "small danger", text: "Stop", onclick: (e) => this.stop(e, c) })
      : null;
    return el(
      "tr",
      { dataset: { id: c.id, state: c.state } },
      el(
        "td",
        { class: "cap-id" },
        el("a", { href: `captures/${c.id}`, text: c.id }),
        c.label ? el("div", { class: "cap-label", dir: "auto", text: c.label }) : null,
      ),
      el("td", {}, stateBadge(c.state), c.kind && c.kind !== "torch" ? el("span", { class: "tag", text: c.kind }) : null),
      el("td", { class: "mono", text: c.stages.join(", ") }),
      el("td", { class: "window" }, windowText(c)),
      el("td", {}, el("div", { class: "verdicts" }, verdicts)),
      el("td", { class: "actions" }, stop),
    );
  }

  async stop(evt, c) {
    evt.target.disabled = true;
    clear(this.stopNotice);
    try {
      await stopCapture(c.id);
    } catch (e) {
      clear(this.stopNotice, errorBox(e, el("div", { class: "muted small", text: `while stopping ${c.id}` })));
    }
    await this.refresh();
    this.poll();
  }
}

export function windowText(c) {
  const parts = [];
  if (c.started_at) {
    const end = c.stopped_at || c.stop_requested_at || (LIVE.has(c.state) ? new Date().toISOString() : null);
    const len = between(c.started_at, end);
    parts.push(el("span", { text: when(c.started_at) }));
    if (len !== null) parts.push(el("span", { class: "muted", text: ` · ${seconds(len)}${c.stopped_at ? "" : " so far"}` }));
  } else {
    parts.push(el("span", { class: "muted", text: `created ${when(c.created_at)}` }));
  }
  const bound = c.duration_s ? `auto-stop ${seconds(c.duration_s)}` : c.lease_s ? `lease ${seconds(c.lease_s)}` : null;
  const sub = [bound, c.stop_reason ? `stop: ${c.stop_reason.replaceAll("_", " ")}` : null].filter(Boolean).join(" · ");
  if (sub) parts.push(el("div", { class: "muted small", text: sub }));
  return parts;
}
