// The live dashboard's view: a header line and four plotly panels (timeline, memory per stage, loss and throughput,
// and the experts' load of a mixture-of-experts model) in a grid that reflows to the output area's width. A panel
// whose figure has no traces (the experts' load of a dense model) is hidden, so it takes no room.
//
// Python owns the state and keeps it whole: each trait is the current picture of one panel (not a delta against the
// last one), so a view that renders late, a second view of the same widget, or a view after the session ended draws
// exactly what the newest state says. Changes only mark panels dirty; one animation frame draws the newest state of
// each dirty panel, and a draw that is still running absorbs the changes that arrive meanwhile, so a slow browser
// skips frames instead of queueing them.
import type { LiveTraits, TypedModel } from "../traits";
import type { PlotlyLike } from "./loader";

export const PANELS = ["timeline", "memory", "series", "experts"] as const;
export type PanelName = (typeof PANELS)[number];

/** One panel's plotly figure: traces and layout, as Python's charts module builds them (src/traits.ts). */
export type Figure = LiveTraits["timeline"];

/** The header line: the session's state, and what the last iteration did. */
export type Header = LiveTraits["header"];

/** The part of anywidget's model this view uses (also what the tests fake), typed by its traits. */
export type LiveModel = TypedModel<LiveTraits>;

export type Scheduler = (callback: () => void) => unknown;

const CONFIG = {
  displaylogo: false,
  responsive: false, // the view resizes panels itself: JupyterLab's panes change width without a window resize
  modeBarButtonsToRemove: ["select2d", "lasso2d", "toImage"],
};

const CSS = `
.vpipe-live { font: 13px/1.45 system-ui, sans-serif; color: #222; width: 100%; box-sizing: border-box;
  display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 400px), 1fr)); gap: 2px 12px; }
.vpipe-live-header { grid-column: 1 / -1; overflow-wrap: anywhere; }
.vpipe-live-state { font-weight: 600; }
.vpipe-live-state.stopped, .vpipe-live-state.failed { color: #c0392b; }
.vpipe-live-state.running { color: #2e7d32; }
.vpipe-live-state.paused { color: #b26a00; }
.vpipe-live-panel { min-width: 0; position: relative; }
.vpipe-live-panel.wide { grid-column: 1 / -1; }
.vpipe-live-panel.empty { display: none; }
.vpipe-live-note { position: absolute; inset: 40% 0 auto 0; text-align: center; color: #888; }
`;

/** Figure heights: the timeline grows with its lanes (its layout says how tall); the others are fixed. */
function height(figure: Figure | undefined, fallback: number): number {
  const h = figure?.layout?.["height"];
  return typeof h === "number" && h > 0 ? h : fallback;
}

export class LiveView {
  readonly root: HTMLDivElement;
  private readonly header: HTMLDivElement;
  private readonly panels = new Map<PanelName, HTMLDivElement>();
  private readonly dirty = new Set<PanelName>();
  private readonly listeners: [string, () => void][] = [];
  private readonly observer: ResizeObserver | null;
  private readonly resized = new Set<HTMLDivElement>();
  private readonly shown = new Map<PanelName, unknown>(); // the figure each panel drew last (the model's object)
  private plotly: PlotlyLike | null = null;
  private scheduled = false;
  private drawing = false;
  private destroyed = false;
  /** Frames drawn by this view (the newest state each time), and the newest frame number drawn. */
  draws = 0;

  constructor(
    private readonly model: LiveModel,
    el: HTMLElement,
    plotly: Promise<PlotlyLike>,
    private readonly schedule: Scheduler = (cb) => requestAnimationFrame(() => cb()),
  ) {
    const style = document.createElement("style");
    style.textContent = CSS;
    this.root = document.createElement("div");
    this.root.className = "vpipe-live";
    this.root.dataset.testid = "live";
    this.root.dataset.role = model.get("role") ?? "dashboard";
    this.header = document.createElement("div");
    this.header.className = "vpipe-live-header";
    this.header.dataset.testid = "live-header";
    this.root.append(style, this.header);
    for (const name of PANELS) {
      const panel = document.createElement("div");
      // the experts' load is hidden until a figure with traces arrives: a dense model never shows it
      panel.className = "vpipe-live-panel" + (name === "timeline" ? " wide" : name === "experts" ? " empty" : "");
      panel.dataset.testid = `live-${name}`;
      const note = document.createElement("div");
      note.className = "vpipe-live-note";
      note.textContent = "loading plotly.js ...";
      panel.append(note);
      this.panels.set(name, panel);
      this.root.append(panel);
      this.dirty.add(name);
    }
    el.append(this.root);
    this.drawHeader();
    for (const name of [...PANELS, "header", "frame"] as const) {
      const cb = (): void => this.changed(name);
      this.listeners.push([`change:${name}`, cb]);
      model.on(`change:${name}`, cb);
    }
    this.observer = typeof ResizeObserver === "undefined" ? null : new ResizeObserver((entries) => {
      for (const entry of entries) this.resized.add(entry.target as HTMLDivElement);
      this.request();
    });
    for (const panel of this.panels.values()) this.observer?.observe(panel);
    plotly.then((p) => {
      this.plotly = p;
      this.request();
    }, (error: unknown) => {
      for (const panel of this.panels.values()) {
        panel.textContent = `the dashboard could not load plotly.js: ${String(error)}`;
      }
    });
  }

  private changed(name: PanelName | "header" | "frame"): void {
    if (name === "header") this.drawHeader();
    else if (name !== "frame") this.dirty.add(name);
    this.request();
  }

  /** Ask for one draw at the next animation frame (however many changes arrive before it). */
  private request(): void {
    if (this.scheduled || this.destroyed) return;
    this.scheduled = true;
    this.schedule(() => {
      this.scheduled = false;
      void this.flush();
    });
  }

  /** Draw the newest state of every dirty panel; changes that arrive meanwhile are drawn by one more frame. */
  async flush(): Promise<void> {
    const plotly = this.plotly;
    if (plotly === null || this.drawing || this.destroyed) return;
    this.drawing = true;
    const frame = this.model.get("frame");
    try {
      const names = PANELS.filter((n) => this.dirty.has(n));
      this.dirty.clear();
      for (const name of names) await this.drawPanel(plotly, name);
      for (const panel of this.resized) if (panel.dataset.drawn) plotly.Plots.resize(panel);
      this.resized.clear();
      if (names.length) {
        this.draws += 1;
        this.root.dataset.frame = String(typeof frame === "number" ? frame : 0);
        this.root.dataset.draws = String(this.draws);
      }
    } finally {
      this.drawing = false;
    }
    if (this.dirty.size || this.resized.size) this.request();
  }

  private async drawPanel(plotly: PlotlyLike, name: PanelName): Promise<void> {
    const panel = this.panels.get(name);
    const figure: Figure | undefined = this.model.get(name);
    if (!panel || !figure || !Array.isArray(figure.data) || this.shown.get(name) === figure) return;
    this.shown.set(name, figure);
    // Optional panels (the experts' load) are drawn only once they have something to show.
    const empty = name === "experts" && figure.data.length === 0;
    panel.classList.toggle("empty", empty);
    if (empty) return;
    const { width: _width, ...layout } = figure.layout ?? {};
    panel.style.height = `${height(figure, 300)}px`;
    if (!panel.dataset.drawn) panel.replaceChildren(); // the "loading" note
    await plotly.react(panel, figure.data, { ...layout, autosize: true }, CONFIG);
    panel.dataset.drawn = "1";
  }

  private drawHeader(): void {
    const header: Header = this.model.get("header") ?? { state: "", text: "" };
    const name = document.createElement("b");
    name.textContent = "vpipe_lab";
    const state = document.createElement("span");
    state.className = `vpipe-live-state ${header.state}`;
    state.dataset.testid = "live-state";
    state.textContent = header.state;
    const parts: Node[] = [name, document.createTextNode(" · "), state];
    if (header.detail) parts.push(document.createTextNode(` (${header.detail})`));
    if (header.text) parts.push(document.createTextNode(` · ${header.text}`));
    this.header.replaceChildren(...parts);
  }

  destroy(): void {
    this.destroyed = true;
    for (const [event, cb] of this.listeners) this.model.off(event, cb);
    this.observer?.disconnect();
    if (this.plotly) for (const panel of this.panels.values()) this.plotly.purge(panel);
    this.root.remove();
  }
}
