// Built from extension/src by esbuild (npm run build); do not edit by hand.

// src/live/loader.ts
var CACHE_KEY = "__vpipeLabPlotly";
function bytesOf(value) {
  if (value instanceof Uint8Array) return value;
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  throw new TypeError(`expected binary data for plotly.js, got ${Object.prototype.toString.call(value)}`);
}
async function gunzipText(bytes) {
  const copy = new Uint8Array(bytes.byteLength);
  copy.set(bytes);
  const stream = new Blob([copy.buffer]).stream().pipeThrough(new DecompressionStream("gzip"));
  return await new Response(stream).text();
}
async function importSource(source) {
  const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
  try {
    const module = await import(
      /* @vite-ignore */
      url
    );
    return module.default;
  } finally {
    URL.revokeObjectURL(url);
  }
}
function cache() {
  const scope = globalThis;
  return scope[CACHE_KEY] ?? (scope[CACHE_KEY] = /* @__PURE__ */ new Map());
}
function loadPlotly(key, bytes, load = async (b) => await importSource(await gunzipText(b))) {
  const known = cache();
  let pending = known.get(key);
  if (pending === void 0) {
    pending = load(bytes()).then((plotly) => {
      if (typeof plotly?.react !== "function") {
        throw new TypeError("the shipped plotly.js has no react(): the bundle is broken (rebuild extension/)");
      }
      return plotly;
    });
    known.set(key, pending);
    pending.catch(() => known.delete(key));
  }
  return pending;
}

// src/live/view.ts
var PANELS = ["timeline", "memory", "series", "experts"];
var CONFIG = {
  displaylogo: false,
  responsive: false,
  // the view resizes panels itself: JupyterLab's panes change width without a window resize
  modeBarButtonsToRemove: ["select2d", "lasso2d", "toImage"]
};
var CSS = `
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
function height(figure, fallback) {
  const h = figure?.layout?.["height"];
  return typeof h === "number" && h > 0 ? h : fallback;
}
var LiveView = class {
  constructor(model, el, plotly, schedule = (cb) => requestAnimationFrame(() => cb())) {
    this.model = model;
    this.schedule = schedule;
    this.panels = /* @__PURE__ */ new Map();
    this.dirty = /* @__PURE__ */ new Set();
    this.listeners = [];
    this.resized = /* @__PURE__ */ new Set();
    this.shown = /* @__PURE__ */ new Map();
    // the figure each panel drew last (the model's object)
    this.plotly = null;
    this.scheduled = false;
    this.drawing = false;
    this.destroyed = false;
    /** Frames drawn by this view (the newest state each time), and the newest frame number drawn. */
    this.draws = 0;
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
    for (const name of [...PANELS, "header", "frame"]) {
      const cb = () => this.changed(name);
      this.listeners.push([`change:${name}`, cb]);
      model.on(`change:${name}`, cb);
    }
    this.observer = typeof ResizeObserver === "undefined" ? null : new ResizeObserver((entries) => {
      for (const entry of entries) this.resized.add(entry.target);
      this.request();
    });
    for (const panel of this.panels.values()) this.observer?.observe(panel);
    plotly.then((p) => {
      this.plotly = p;
      this.request();
    }, (error) => {
      for (const panel of this.panels.values()) {
        panel.textContent = `the dashboard could not load plotly.js: ${String(error)}`;
      }
    });
  }
  changed(name) {
    if (name === "header") this.drawHeader();
    else if (name !== "frame") this.dirty.add(name);
    this.request();
  }
  /** Ask for one draw at the next animation frame (however many changes arrive before it). */
  request() {
    if (this.scheduled || this.destroyed) return;
    this.scheduled = true;
    this.schedule(() => {
      this.scheduled = false;
      void this.flush();
    });
  }
  /** Draw the newest state of every dirty panel; changes that arrive meanwhile are drawn by one more frame. */
  async flush() {
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
  async drawPanel(plotly, name) {
    const panel = this.panels.get(name);
    const figure = this.model.get(name);
    if (!panel || !figure || !Array.isArray(figure.data) || this.shown.get(name) === figure) return;
    this.shown.set(name, figure);
    const empty = name === "experts" && figure.data.length === 0;
    panel.classList.toggle("empty", empty);
    if (empty) return;
    const { width: _width, ...layout } = figure.layout ?? {};
    panel.style.height = `${height(figure, 300)}px`;
    if (!panel.dataset.drawn) panel.replaceChildren();
    await plotly.react(panel, figure.data, { ...layout, autosize: true }, CONFIG);
    panel.dataset.drawn = "1";
  }
  drawHeader() {
    const header = this.model.get("header") ?? { state: "", text: "" };
    const name = document.createElement("b");
    name.textContent = "vpipe_lab";
    const state = document.createElement("span");
    state.className = `vpipe-live-state ${header.state}`;
    state.dataset.testid = "live-state";
    state.textContent = header.state;
    const parts = [name, document.createTextNode(" \xB7 "), state];
    if (header.detail) parts.push(document.createTextNode(` (${header.detail})`));
    if (header.text) parts.push(document.createTextNode(` \xB7 ${header.text}`));
    this.header.replaceChildren(...parts);
  }
  destroy() {
    this.destroyed = true;
    for (const [event, cb] of this.listeners) this.model.off(event, cb);
    this.observer?.disconnect();
    if (this.plotly) for (const panel of this.panels.values()) this.plotly.purge(panel);
    this.root.remove();
  }
};

// src/live/index.ts
function render({ model, el }) {
  const plotly = loadPlotly(String(model.get("_plotly_key") ?? ""), () => bytesOf(model.get("_plotly")));
  const view = new LiveView(model, el, plotly);
  return () => view.destroy();
}
var index_default = { render };
export {
  index_default as default
};
