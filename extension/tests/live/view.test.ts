import { beforeEach, describe, expect, it } from "vitest";
import type { LiveTraits } from "../../src/traits";
import type { PlotlyLike } from "../../src/live/loader";
import { LiveView, type LiveModel } from "../../src/live/view";

class FakeModel implements LiveModel {
  data: Record<string, unknown>;
  private handlers = new Map<string, Set<() => void>>();
  constructor(data: Record<string, unknown>) {
    this.data = { ...data };
  }
  get<K extends keyof LiveTraits & string>(name: K): LiveTraits[K] {
    return this.data[name] as LiveTraits[K];
  }
  set(name: string, value: unknown): void {
    this.data[name] = value;
    this.handlers.get(`change:${name}`)?.forEach((cb) => cb());
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

/** A plotly that records what it was asked to draw; each react() resolves when the test says so. */
class FakePlotly implements PlotlyLike {
  drawn: { el: HTMLElement; data: unknown[]; layout: Record<string, unknown> }[] = [];
  resized = 0;
  purged = 0;
  hold = false;
  private waiting: (() => void)[] = [];
  Plots = { resize: (): void => { this.resized += 1; } };
  react(el: HTMLElement, data: unknown[], layout: Record<string, unknown>): Promise<unknown> {
    this.drawn.push({ el, data, layout });
    if (!this.hold) return Promise.resolve();
    return new Promise<void>((resolve) => this.waiting.push(resolve));
  }
  release(): void {
    this.hold = false;
    for (const r of this.waiting.splice(0)) r();
  }
  purge(): void {
    this.purged += 1;
  }
}

const fig = (title: string, points = 1): Record<string, unknown> => ({
  data: [{ type: "scatter", x: Array.from({ length: points }, (_, i) => i), y: [] }],
  layout: { title: { text: title }, height: 320, width: 999 },
});

/** Animation frames run when the test flushes them. */
class Frames {
  queue: (() => void)[] = [];
  schedule = (cb: () => void): void => { this.queue.push(cb); };
  async run(): Promise<void> {
    await new Promise((r) => setTimeout(r, 0)); // promises settled first (plotly.js loaded, draws finished)
    for (let i = 0; i < 10 && this.queue.length; i++) {
      for (const cb of this.queue.splice(0)) cb();
      await new Promise((r) => setTimeout(r, 0));
    }
  }
}

let el: HTMLElement;
beforeEach(() => {
  document.body.replaceChildren();
  el = document.createElement("div");
  document.body.append(el);
});

function start(data: Record<string, unknown>, plotly = new FakePlotly()): [FakeModel, FakePlotly, Frames, LiveView] {
  const model = new FakeModel(data);
  const frames = new Frames();
  const view = new LiveView(model, el, Promise.resolve(plotly), frames.schedule);
  return [model, plotly, frames, view];
}

describe("LiveView", () => {
  it("draws the state it finds when it renders, however late (whole figures, not deltas)", async () => {
    const [, plotly, frames, view] = start({
      header: { state: "running", text: "iteration 7" }, timeline: fig("t"), memory: fig("m"), series: fig("s"), frame: 7,
    });
    await frames.run();
    expect(plotly.drawn.map((d) => (d.layout["title"] as { text: string }).text)).toEqual(["t", "m", "s"]);
    expect(plotly.drawn.every((d) => d.layout["autosize"] === true && !("width" in d.layout))).toBe(true);
    expect(view.root.dataset.frame).toBe("7");
    expect(el.querySelector('[data-testid="live-header"]')?.textContent).toBe("vpipe_lab · running · iteration 7");
    expect((el.querySelector('[data-testid="live-timeline"]') as HTMLElement).style.height).toBe("320px");
  });

  it("coalesces bursts: one frame draws only the newest state of each changed panel", async () => {
    const [model, plotly, frames, view] = start({ timeline: fig("t0"), memory: fig("m0"), series: fig("s0"), frame: 1 });
    await frames.run();
    plotly.drawn = [];
    for (let i = 1; i <= 20; i++) {
      model.set("timeline", fig(`t${i}`));
      model.set("frame", 1 + i);
    }
    expect(frames.queue.length).toBe(1); // one animation frame requested for 20 changes
    await frames.run();
    expect(plotly.drawn.map((d) => (d.layout["title"] as { text: string }).text)).toEqual(["t20"]);
    expect(view.root.dataset.frame).toBe("21");
  });

  it("never draws twice at once: changes during a slow draw are drawn once, newest, after it", async () => {
    const [model, plotly, frames, view] = start({ timeline: fig("t0"), memory: fig("m0"), series: fig("s0"), frame: 1 });
    plotly.hold = true;
    await frames.run(); // the first draw is stuck in react()
    expect(plotly.drawn.length).toBe(1);
    model.set("series", fig("s1"));
    model.set("series", fig("s2"));
    model.set("frame", 3);
    await frames.run();
    expect(plotly.drawn.length).toBe(1); // still waiting for the first react()
    plotly.release();
    await frames.run();
    const titles = plotly.drawn.map((d) => (d.layout["title"] as { text: string }).text);
    expect(titles).toEqual(["t0", "m0", "s2"]);
    expect(view.root.dataset.frame).toBe("3");
  });

  it("shows the experts' load only once a figure with traces arrives (a dense model never shows it)", async () => {
    const [model, plotly, frames] = start({ timeline: fig("t"), memory: fig("m"), series: fig("s"), frame: 1 });
    const panel = el.querySelector('[data-testid="live-experts"]') as HTMLElement;
    await frames.run();
    expect(panel.classList.contains("empty")).toBe(true); // no figure yet
    model.set("experts", { data: [], layout: { title: { text: "e0" } } });
    await frames.run();
    expect(panel.classList.contains("empty")).toBe(true); // an empty figure: still hidden, nothing drawn
    expect(plotly.drawn.some((d) => d.el === panel)).toBe(false);
    model.set("experts", { data: [{ type: "heatmap", z: [[0.5, 0.5]] }], layout: { title: { text: "e1" }, height: 330 } });
    await frames.run();
    expect(panel.classList.contains("empty")).toBe(false);
    expect(plotly.drawn.filter((d) => d.el === panel).map((d) => (d.layout["title"] as { text: string }).text))
      .toEqual(["e1"]);
  });

  it("shows the header as text (a failure's cause cannot inject markup)", () => {
    start({ header: { state: "failed", detail: "<img src=x onerror=alert(1)>", text: "iteration 3" } });
    const header = el.querySelector('[data-testid="live-header"]') as HTMLElement;
    expect(header.querySelector("img")).toBeNull();
    expect(header.textContent).toContain("(<img src=x onerror=alert(1)>)");
    expect(el.querySelector('[data-testid="live-state"]')?.className).toContain("failed");
  });

  it("says so in every panel when plotly.js cannot load, instead of drawing nothing", async () => {
    const model = new FakeModel({ timeline: fig("t") });
    new LiveView(model, el, Promise.reject(new Error("boom")), () => undefined);
    await new Promise((r) => setTimeout(r, 0));
    const panels = [...el.querySelectorAll(".vpipe-live-panel")].map((p) => p.textContent);
    expect(panels.length).toBe(4);
    expect(panels.every((t) => t?.includes("could not load plotly.js") && t.includes("boom"))).toBe(true);
  });

  it("lets go of the model and plotly when destroyed", async () => {
    const [model, plotly, frames, view] = start({ timeline: fig("t"), memory: fig("m"), series: fig("s") });
    await frames.run();
    const before = model.listeners();
    expect(before).toBeGreaterThan(0);
    view.destroy();
    expect(model.listeners()).toBe(0);
    expect(plotly.purged).toBe(4);
    expect(el.querySelector('[data-testid="live"]')).toBeNull();
    model.set("timeline", fig("after"));
    expect(frames.queue.length).toBe(0);
  });
});
