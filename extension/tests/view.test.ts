import { beforeEach, describe, expect, it } from "vitest";
import type { EditorTraits } from "../src/traits";
import type { EditorMessage } from "../src/messages";
import { PartitionView, blockLabel, type Model } from "../src/view";

class FakeModel implements Model {
  data: Record<string, unknown>;
  saves = 0;
  sent: EditorMessage[] = [];
  private handlers = new Map<string, Set<() => void>>();
  constructor(data: Record<string, unknown>) {
    this.data = { ...data };
  }
  get<K extends keyof EditorTraits & string>(name: K): EditorTraits[K] {
    return this.data[name] as EditorTraits[K];
  }
  set(name: string, value: unknown): void {
    this.data[name] = value;
    this.handlers.get(`change:${name}`)?.forEach((cb) => cb());
  }
  save_changes(): void {
    this.saves += 1;
  }
  send(content: EditorMessage): void {
    this.sent.push(content);
  }
  /** What Python does with a draft message: it becomes the draft traits. */
  echo(): void {
    const last = this.sent[this.sent.length - 1];
    if (last?.kind === "draft") {
      this.set("draft_boundaries", last.boundaries);
      this.set("draft_policies", last.policies);
      if (last.schedule !== undefined) this.set("draft_schedule", last.schedule);
      if (last.sharding !== undefined) this.set("draft_sharding", last.sharding);
    }
  }
  on(event: string, cb: () => void): void {
    if (!this.handlers.has(event)) this.handlers.set(event, new Set());
    this.handlers.get(event)?.add(cb);
  }
  off(event?: string | null, cb?: (() => void) | null): void {
    if (event && cb) this.handlers.get(event)?.delete(cb);
  }
  listeners(): number {
    return [...this.handlers.values()].reduce((n, s) => n + s.size, 0);
  }
}

const LAYERS = Array.from({ length: 10 }, (_, i) => ({ name: `${i}:Linear`, weight: 1 }));

function model(): FakeModel {
  return new FakeModel({
    layers: LAYERS,
    boundaries: [0, 5, 10],
    draft_boundaries: [0, 5, 10],
    policies: Array(10).fill("keep"),
    draft_policies: Array(10).fill("keep"),
    schedule: "1f1b",
    draft_schedule: "1f1b",
    schedules: ["gpipe", "1f1b", "interleaved-1f1b", "zbv"],
    draft_placement: [],
    preview: {
      current: { iteration_s: 0.1, stage_s: [0.02, 0.01], peak_bytes: [3e6, 1e6], budget_bytes: [4e6, 4e6], feasible: true },
    },
    status: { state: "idle", message: "" },
  });
}

function pointer(type: string, target: EventTarget, clientX: number): void {
  target.dispatchEvent(new PointerEvent(type, { clientX, bubbles: true, pointerId: 1 }));
}

describe("PartitionView", () => {
  let el: HTMLElement;
  let m: FakeModel;
  let view: PartitionView;
  beforeEach(() => {
    document.body.replaceChildren();
    el = document.createElement("div");
    document.body.append(el);
    m = model();
    view = new PartitionView(m, el, 1000); // ten layers, 100 px each
  });

  const q = (id: string): HTMLElement => {
    const found = el.querySelector<HTMLElement>(`[data-testid="${id}"]`);
    if (!found) throw new Error(`no element ${id}`);
    return found;
  };

  it("draws layers coloured by stage and one handle per interior boundary", () => {
    expect(el.querySelectorAll(".vpipe-layer")).toHaveLength(10);
    expect(q("layer-4").dataset.stage).toBe("0");
    expect(q("layer-5").dataset.stage).toBe("1");
    expect(el.querySelectorAll(".vpipe-handle")).toHaveLength(1);
    expect(q("boundary-1").style.left).toBe("500px");
    expect((q("apply") as HTMLButtonElement).disabled).toBe(true);
    expect(q("summary").textContent).toContain("predicted: 100.00 ms");
  });

  it("colours chunks by the stage that runs them when there are virtual stages", () => {
    m.set("stages", 2);
    m.set("boundaries", [0, 2, 5, 7, 10]);
    m.set("draft_boundaries", [0, 2, 5, 7, 10]);
    expect(el.querySelectorAll(".vpipe-handle")).toHaveLength(3);
    expect([0, 2, 5, 7].map((i) => q(`layer-${i}`).dataset.stage)).toEqual(["0", "1", "0", "1"]);
    expect(q("layer-5").dataset.chunk).toBe("2");
    expect(q("layer-5").title).toContain("stage 0 (chunk 2)");
    expect(q("layer-5").style.background).toBe(q("layer-0").style.background);
    expect(q("boundary-2").title).toContain("chunk 1 (stage 1) and chunk 2 (stage 0)");
  });

  it("follows the plan's placement: ZBV's V turns on the last stage", () => {
    m.set("stages", 2);
    m.set("placement", [0, 1, 1, 0]);
    m.set("boundaries", [0, 2, 5, 7, 10]);
    m.set("draft_boundaries", [0, 2, 5, 7, 10]);
    expect([0, 2, 5, 7].map((i) => q(`layer-${i}`).dataset.stage)).toEqual(["0", "1", "1", "0"]);
    expect(q("layer-5").title).toContain("stage 1 (chunk 2)");
    expect(q("layer-7").style.background).toBe(q("layer-0").style.background);
    expect(q("boundary-2").title).toContain("chunk 1 (stage 1) and chunk 2 (stage 1)");
  });

  it("drags a boundary, redraws while moving and commits once on release", () => {
    pointer("pointerdown", q("boundary-1"), 500);
    pointer("pointermove", el.querySelector(".vpipe-bar") as HTMLElement, 310);
    expect(q("boundary-1").style.left).toBe("300px"); // snapped to the edge of layer 3
    expect(q("layer-3").dataset.stage).toBe("1");
    expect(m.sent).toHaveLength(0); // nothing sent while dragging
    pointer("pointerup", el.querySelector(".vpipe-bar") as HTMLElement, 290);
    expect(m.sent).toEqual([{ kind: "draft", boundaries: [0, 3, 10], policies: Array(10).fill("keep"), schedule: "1f1b" }]);
    expect(m.saves).toBe(0); // a message, not a trait write
    // Until Python echoes the draft, the view keeps showing what was dropped (no flicker back).
    expect(q("boundary-1").style.left).toBe("300px");
    expect(q("layer-3").classList.contains("changed")).toBe(true);
    expect((q("apply") as HTMLButtonElement).disabled).toBe(false);
    m.echo();
    expect(q("boundary-1").style.left).toBe("300px");
  });

  it("says it is measuring until Python answers a draft, never the previous draft's number", () => {
    m.set("preview", {
      current: { iteration_s: 0.1, stage_s: [0.02, 0.01], peak_bytes: [1, 1], budget_bytes: [0, 0], feasible: true },
      draft: { iteration_s: 0.1, stage_s: [0.02, 0.01], peak_bytes: [1, 1], budget_bytes: [0, 0], feasible: true },
    });
    expect(q("summary").textContent).toBe("predicted: 100.00 ms per iteration");
    pointer("pointerdown", q("boundary-1"), 500);
    pointer("pointerup", el.querySelector(".vpipe-bar") as HTMLElement, 290);
    expect(q("summary").textContent).toBe("what-if: measuring the new draft...");
    const stagebar = el.querySelector(".vpipe-stagebar") as HTMLElement;
    expect(stagebar.classList.contains("stale")).toBe(true); // still there (nothing below moves), faded
    expect(stagebar.children).toHaveLength(2);
    m.set("preview", { ...m.get("preview"), calibration: "x1.000" }); // a redraw of the old draft changes nothing
    expect(q("summary").textContent).toBe("what-if: measuring the new draft...");
    m.echo(); // Python's answer: the draft traits (with their preview)
    m.set("preview", { ...m.get("preview"), draft: { ...m.get("preview").draft!, iteration_s: 0.11 } });
    expect(q("summary").textContent).toBe("what-if: 110.00 ms per iteration (now 100.00 ms, 10.0%)");
    expect(stagebar.classList.contains("stale")).toBe(false);
    q("layer-0").click(); // keep -> swap: awaited
    expect(q("summary").textContent).toBe("what-if: measuring the new draft...");
    q("layer-0").click(); // -> recompute -> keep: the draft Python holds, nothing to await
    q("layer-0").click();
    expect(m.sent.map((s) => s.policies[0])).toEqual(["keep", "swap", "recompute", "keep"]);
    expect(q("summary").textContent).toBe("what-if: 110.00 ms per iteration (now 100.00 ms, 10.0%)");
  });

  it("never empties a stage", () => {
    pointer("pointerdown", q("boundary-1"), 500);
    pointer("pointerup", el.querySelector(".vpipe-bar") as HTMLElement, 2000);
    expect(m.sent[0]).toMatchObject({ kind: "draft", boundaries: [0, 9, 10] });
  });

  it("cycles a layer's policy on click", () => {
    q("layer-2").click();
    expect(m.sent[0]?.policies[2]).toBe("swap");
    m.echo();
    q("layer-2").click();
    expect(m.sent[1]?.policies[2]).toBe("recompute");
    expect(q("layer-2").textContent).toBe("R 2:Linear"); // the policy's letter, then the name where it fits
  });

  it("labels blocks with what their width holds, everything on hover", () => {
    const layer = { name: "transformer.h.0", weight: 1, forward_ms: 1.234, backward_ms: 2.5, activation_bytes: 3 * 2 ** 20 };
    const text = (w: number, p: "keep" | "swap" = "keep"): string =>
      blockLabel(layer, p, w).map((s) => s.textContent).join("");
    expect(text(20)).toBe("");
    expect(text(20, "swap")).toBe("S");
    expect(text(80)).toBe("transformer"); // as many characters as fit
    expect(text(300)).toBe("transformer.h.0 1.2/2.5 ms");
    m.set("layers", LAYERS.map((l, i) => (i === 0 ? layer : l)));
    expect(q("layer-0").title).toContain("transformer.h.0: stage 0, keep, forward 1.23 ms, backward 2.50 ms, " +
      "activations 3.00 MiB/mb");
  });

  it("shows the what-if preview and the over-budget stages", () => {
    m.set("draft_boundaries", [0, 8, 10]);
    m.set("preview", {
      current: { iteration_s: 0.1, stage_s: [0.02, 0.01], peak_bytes: [3e6, 1e6], budget_bytes: [4e6, 4e6], feasible: true },
      draft: { iteration_s: 0.12, stage_s: [0.03, 0.005], peak_bytes: [5e6, 1e6], budget_bytes: [4e6, 4e6], feasible: false },
    });
    expect(q("summary").textContent).toContain("what-if: 120.00 ms per iteration (now 100.00 ms, 20.0%)");
    expect(q("summary").textContent).toContain("does NOT fit");
    expect(el.querySelectorAll(".vpipe-stage")[0]?.textContent).toContain("4.77 MiB of 3.81 MiB");
    expect(q("summary").title).toContain("not calibrated");
    m.set("preview", { ...m.get("preview"), calibration: "x0.950: the running plan measured 95.00 ms" });
    expect(q("summary").title).toBe("calibrated x0.950: the running plan measured 95.00 ms");
  });

  it("shows the running plan's schedule grid, and the draft's beside it, each with its CSV", () => {
    const est = { iteration_s: 0.1, stage_s: [0.02, 0.01], peak_bytes: [3e6, 1e6], budget_bytes: [4e6, 4e6],
      feasible: true };
    m.set("preview", { current: { ...est, grid: "        Rank 0 Rank 1\nStep 0: 0F0         \n", grid_csv: "step,rank 0,rank 1\n0,0F0,\n" } });
    expect(q("grid-running").querySelector("pre")?.textContent).toContain("Step 0: 0F0");
    expect(el.querySelector('[data-testid="grid-draft"]')).toBeNull(); // no draft yet
    const csv = q("grid-running-csv") as HTMLAnchorElement;
    expect(csv.download).toBe("schedule-running.csv");
    expect(decodeURIComponent(csv.href.split(",").slice(1).join(","))).toBe("step,rank 0,rank 1\n0,0F0,\n");
    m.set("draft_boundaries", [0, 8, 10]);
    m.set("preview", { current: { ...est, grid: "a", grid_csv: "a" }, draft: { ...est, grid: "b", grid_csv: "b" } });
    expect(q("grid-draft").querySelector("pre")?.textContent).toBe("b");
    expect(q("grid-running").querySelector("pre")?.textContent).toBe("a");
  });

  it("shows a sharded job's stages with their sharding: a click cycles one, sent with the draft and its Apply", () => {
    expect(el.querySelector(".vpipe-sharding")).toBeNull(); // whole devices: nothing to shard
    m.set("sharding", ["hold", "hold"]);
    m.set("draft_sharding", ["hold", "hold"]);
    expect(q("sharding-0").textContent).toBe("hold");
    expect(q("sharding-1").title).toContain("stage 1's shards: gather the parameters once");
    q("sharding-1").click();
    expect(m.sent[0]).toEqual({ kind: "draft", boundaries: [0, 5, 10], policies: Array(10).fill("keep"),
      schedule: "1f1b", sharding: ["hold", "regather"] });
    expect(q("summary").textContent).toContain("measuring"); // until Python answers with the draft
    m.echo();
    expect(q("sharding-1").textContent).toBe("regather");
    expect(q("sharding-1").className).toContain("changed");
    expect((q("apply") as HTMLButtonElement).disabled).toBe(false); // a sharding alone is a change to apply
    q("layer-0").click(); // a policy clicked keeps the draft's sharding
    expect(m.sent[1]?.sharding).toEqual(["hold", "regather"]);
    m.echo();
    q("apply").click();
    expect(m.sent[2]).toMatchObject({ kind: "apply", sharding: ["hold", "regather"] });
    m.set("sharding", ["hold", "regather"]); // applied: the running plan's now
    q("sharding-1").click();
    q("sharding-1").click();
    q("sharding-1").click(); // regather -> scatter -> stream -> hold (each click drafts from the newest)
    expect(m.sent.map((x) => x.sharding?.[1])).toEqual(["regather", "regather", "regather", "scatter", "stream", "hold"]);
  });

  it("applies with the what-if the page showed for the draft", () => {
    const est = { iteration_s: 0.1, stage_s: [0.02, 0.01], peak_bytes: [3e6, 1e6], budget_bytes: [4e6, 4e6],
      feasible: true };
    m.set("draft_boundaries", [0, 3, 10]);
    m.set("preview", { current: est, draft: { ...est, iteration_s: 0.21888 } });
    expect(q("summary").textContent).toContain("218.88 ms");
    q("apply").click();
    expect(m.sent).toEqual([
      { kind: "apply", boundaries: [0, 3, 10], policies: Array(10).fill("keep"), schedule: "1f1b", shown_s: 0.21888 },
    ]);
  });

  it("applies: pending, then what Python reports", () => {
    m.set("draft_boundaries", [0, 3, 10]);
    q("apply").click();
    expect(m.sent).toEqual([
      { kind: "apply", boundaries: [0, 3, 10], policies: Array(10).fill("keep"), schedule: "1f1b" },
    ]);
    expect(q("status").textContent).toContain("pending");
    expect((q("apply") as HTMLButtonElement).disabled).toBe(true);
    m.set("boundaries", [0, 3, 10]);
    m.set("status", { state: "applied", message: "applied at iteration 7", iteration: 7 });
    expect(q("status").textContent).toBe("applied at iteration 7");
    expect(q("status").className).toContain("applied");
    m.set("status", { state: "error", message: "PlanError: nope" });
    expect(q("status").className).toContain("error");
  });

  it("resets the drafts and cleans up its listeners", () => {
    m.set("draft_boundaries", [0, 2, 10]);
    q("reset").click();
    expect(m.sent[0]).toMatchObject({ kind: "draft", boundaries: [0, 5, 10] });
    expect(q("boundary-1").style.left).toBe("500px");
    const before = m.listeners();
    view.destroy();
    expect(m.listeners()).toBe(before - 15);
    expect(el.children).toHaveLength(0);
  });

  it("offers the registry's schedules and sends a choice as a draft, drawn in the draft's placement", () => {
    const select = q("schedule") as HTMLSelectElement;
    expect(Array.from(select.options, (o) => o.value)).toEqual(["gpipe", "1f1b", "interleaved-1f1b", "zbv"]);
    expect(select.value).toBe("1f1b");
    select.value = "zbv";
    select.dispatchEvent(new Event("change"));
    expect(m.sent).toEqual([{ kind: "draft", boundaries: [0, 5, 10], policies: Array(10).fill("keep"), schedule: "zbv" }]);
    expect((q("apply") as HTMLButtonElement).disabled).toBe(false); // another schedule is a change
    // Python re-cuts the draft into the V's four chunks and echoes it with their placement
    m.set("draft_schedule", "zbv");
    m.set("draft_placement", [0, 1, 1, 0]);
    m.set("draft_boundaries", [0, 3, 6, 8, 10]);
    expect(select.value).toBe("zbv");
    expect(select.classList.contains("changed")).toBe(true);
    expect([0, 3, 6, 8].map((i) => q(`layer-${i}`).dataset.stage)).toEqual(["0", "1", "1", "0"]);
    q("apply").click();
    expect(m.sent[1]).toMatchObject({ kind: "apply", boundaries: [0, 3, 6, 8, 10], schedule: "zbv" });
    m.set("schedules", ["gpipe", "1f1b", "interleaved-1f1b", "zbv", "gpipe-lifo"]); // registered meanwhile
    expect(Array.from(select.options, (o) => o.value)).toContain("gpipe-lifo");
  });

  it("freezes when the session ended: no drags, clicks or apply", () => {
    m.set("draft_boundaries", [0, 3, 10]);
    m.set("status", { state: "ended", message: "session ended (stopped): this editor is frozen" });
    expect(el.querySelector(".vpipe-editor")?.classList.contains("ended")).toBe(true);
    expect((q("apply") as HTMLButtonElement).disabled).toBe(true);
    expect((q("reset") as HTMLButtonElement).disabled).toBe(true);
    expect((q("schedule") as HTMLSelectElement).disabled).toBe(true);
    q("layer-2").click();
    pointer("pointerdown", q("boundary-1"), 300);
    pointer("pointerup", el.querySelector(".vpipe-bar") as HTMLElement, 700);
    expect(m.sent).toHaveLength(0);
    expect(q("status").textContent).toContain("frozen");
  });
});

describe("PartitionView scale", () => {
  let el: HTMLElement;
  let m: FakeModel;
  beforeEach(() => {
    document.body.replaceChildren();
    el = document.createElement("div");
    document.body.append(el);
    m = model();
    new PartitionView(m, el, 1000);
  });
  const q = (id: string): HTMLElement => el.querySelector<HTMLElement>(`[data-testid="${id}"]`) as HTMLElement;
  const bar = (): HTMLElement => el.querySelector(".vpipe-bar") as HTMLElement;

  it("keeps its blocks and handles between draws, so new sizes ease in (CSS transitions)", () => {
    const block = q("layer-0");
    const handle = q("boundary-1");
    m.set("layers", LAYERS.map((l, i) => ({ ...l, weight: i === 0 ? 10 : 1 })));
    expect(q("layer-0")).toBe(block); // the same element: its width transitions instead of being redrawn
    expect(q("boundary-1")).toBe(handle);
    expect(parseFloat(block.style.width)).toBeGreaterThan(300);
  });

  it("keeps the handle under the pointer while new sizes arrive during a drag", () => {
    pointer("pointerdown", q("boundary-1"), 500);
    pointer("pointermove", bar(), 310);
    expect(q("boundary-1").style.left).toBe("300px");
    expect(bar().classList.contains("dragging")).toBe(true); // transitions off: the handle follows the pointer
    m.set("layers", LAYERS.map((l, i) => ({ ...l, weight: i < 3 ? 5 : 1 }))); // a re-measure mid-drag
    expect(q("boundary-1").style.left).toBe("300px");
    pointer("pointerup", bar(), 305);
    expect(bar().classList.contains("dragging")).toBe(false);
    expect(q("boundary-1").style.left).not.toBe("300px"); // released: the new sizes take over (and ease in)
  });
});
