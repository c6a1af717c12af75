// Built from extension/src by esbuild (npm run build); do not edit by hand.

// src/vocabulary.ts
var POLICIES = ["keep", "swap", "recompute"];
var SHARDINGS = ["hold", "regather", "scatter", "stream"];

// src/logic.ts
var POLICIES2 = POLICIES;
var SHARDINGS2 = SHARDINGS;
var SHARDING_HELP = {
  hold: "gather the parameters once, reduce the gradients once per iteration (the most memory; torchtitan's PP layout)",
  regather: "gather each unit before every forward and backward, reduce once per iteration",
  scatter: "gather once, reduce-scatter the gradients after every micro-batch",
  stream: "gather and reduce every micro-batch (the least memory, the most collectives)"
};
function cycleSharding(m) {
  const i = SHARDINGS2.indexOf(m);
  return SHARDINGS2[(i + 1) % SHARDINGS2.length] ?? "hold";
}
function cyclePolicy(p) {
  const i = POLICIES2.indexOf(p);
  return POLICIES2[(i + 1) % POLICIES2.length] ?? "keep";
}
function stageOf(layer, bounds) {
  for (let s = 0; s + 1 < bounds.length; s++) {
    if (layer >= (bounds[s] ?? 0) && layer < (bounds[s + 1] ?? 0)) return s;
  }
  return -1;
}
function boundaryRange(bounds, index) {
  if (index <= 0 || index >= bounds.length - 1) throw new RangeError(`boundary ${index} is not movable`);
  return [(bounds[index - 1] ?? 0) + 1, (bounds[index + 1] ?? 0) - 1];
}
function moveBoundary(bounds, index, target) {
  const [lo, hi] = boundaryRange(bounds, index);
  const out = bounds.slice();
  out[index] = Math.min(hi, Math.max(lo, Math.round(target)));
  return out;
}
function layerEdges(weights, width, minWidth = 12) {
  const n = weights.length;
  const total = weights.reduce((a, w) => a + Math.max(0, w), 0);
  const spare = Math.max(0, width - n * minWidth);
  const edges = [0];
  for (const w of weights) {
    const share = total > 0 ? Math.max(0, w) / total : 1 / n;
    const wide = width > n * minWidth ? minWidth + spare * share : width / n;
    edges.push((edges[edges.length - 1] ?? 0) + wide);
  }
  return edges;
}
function nearestEdge(x, edges) {
  let best = 0;
  let dist = Infinity;
  edges.forEach((e, i) => {
    const d = Math.abs(e - x);
    if (d < dist) {
      dist = d;
      best = i;
    }
  });
  return best;
}
function sameList(a, b) {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}
function formatBytes(n) {
  const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [unit, size] of units) if (Math.abs(n) >= size) return `${(n / size).toFixed(2)} ${unit}`;
  return `${Math.round(n)} B`;
}
function formatSeconds(s) {
  if (!Number.isFinite(s)) return "n/a";
  if (s >= 1) return `${s.toFixed(3)} s`;
  return `${(s * 1e3).toFixed(2)} ms`;
}
var STAGE_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#EECA3B", "#9D755D"];
function stageColor(stage) {
  return STAGE_COLORS[(stage % STAGE_COLORS.length + STAGE_COLORS.length) % STAGE_COLORS.length] ?? "#888";
}

// src/view.ts
var CSS = `
.vpipe-editor { font: 12px/1.4 system-ui, sans-serif; color: #222; user-select: none; }
.vpipe-bar { position: relative; height: 46px; margin: 8px 0 4px; }
.vpipe-layer { position: absolute; top: 0; height: 34px; box-sizing: border-box; border: 1px solid #fff;
  border-radius: 3px; color: #fff; font-weight: 600; text-align: center; line-height: 34px; cursor: pointer;
  overflow: hidden; transition: left .6s ease, width .6s ease, background-color .3s; }
.vpipe-bar.dragging .vpipe-layer, .vpipe-bar.dragging .vpipe-handle { transition: none; }
.vpipe-layer.changed { outline: 2px dashed #222; outline-offset: -3px; }
.vpipe-layer .vpipe-label { font-weight: 400; font-size: 11px; white-space: nowrap; }
.vpipe-handle { position: absolute; top: -4px; width: 10px; height: 42px; margin-left: -5px; cursor: col-resize;
  background: #222; border-radius: 3px; opacity: .75; touch-action: none; transition: left .6s ease; }
.vpipe-handle.dragging { opacity: 1; background: #E45756; }
.vpipe-stagebar { display: flex; gap: 6px; flex-wrap: wrap; margin: 4px 0; }
.vpipe-stage { min-width: 130px; }
.vpipe-stagebar.stale { opacity: 0.45; }
.vpipe-mem { height: 8px; background: #eee; border-radius: 4px; overflow: hidden; }
.vpipe-mem > div { height: 100%; }
.vpipe-row { display: flex; gap: 8px; align-items: center; margin-top: 6px; }
.vpipe-status.error { color: #c0392b; } .vpipe-status.applied { color: #2e7d32; } .vpipe-status.pending { color: #b26a00; }
.vpipe-editor button, .vpipe-editor select { padding: 3px 10px; }
.vpipe-editor.ended .vpipe-bar { opacity: .6; } .vpipe-editor.ended .vpipe-handle { display: none; }
.vpipe-status.ended { color: #666; font-style: italic; }
.vpipe-grids { margin-top: 6px; } .vpipe-grids summary { cursor: pointer; color: #444; }
.vpipe-gridrow { display: flex; gap: 16px; flex-wrap: wrap; align-items: flex-start; }
.vpipe-grid pre { font: 11px/1.3 ui-monospace, monospace; margin: 2px 0; max-height: 320px; overflow: auto;
  background: #f7f7f7; padding: 4px 6px; border-radius: 3px; }
.vpipe-grid a { font-size: 11px; margin-left: 8px; }
.vpipe-editor button.vpipe-sharding { padding: 0 6px; margin-left: 6px; font-size: 11px; }
.vpipe-sharding.changed { outline: 2px dashed #222; outline-offset: 1px; }
`;
function list(model, name) {
  const v = model.get(name);
  return Array.isArray(v) ? v : [];
}
function blockLabel(layer, policy, width) {
  const letter = policy === "keep" ? "" : policy === "swap" ? "S" : "R";
  const px = 6.5;
  const parts = [];
  if (width >= 40) parts.push(layer.name);
  if (width >= 110 && layer.forward_ms !== void 0 && layer.backward_ms !== void 0) {
    parts.push(`${layer.forward_ms.toFixed(1)}/${layer.backward_ms.toFixed(1)} ms`);
  }
  const room = Math.max(0, Math.floor((width - 8) / px) - (letter ? 2 : 0));
  const text = parts.join(" ").slice(0, room);
  return [letter, text].filter((t) => t).map((t, k) => {
    const span = document.createElement("span");
    span.className = k === 0 && letter ? "vpipe-policy" : "vpipe-label";
    span.textContent = k === 0 && letter ? `${t}${text ? " " : ""}` : t;
    return span;
  });
}
var PartitionView = class {
  constructor(model, el, width = 0) {
    this.model = model;
    this.el = el;
    this.width = width;
    // While a boundary is dragged the bar keeps the geometry it had when the drag began (``edges``): re-measured sizes
    // arriving meanwhile must not move the handle out from under the pointer. They ease in once it is released.
    this.dragging = null;
    this.blocks = [];
    this.handles = [];
    // The draft just sent to Python, shown until Python's draft traits echo it (no flicker back to the old one).
    this.local = null;
    this.pending = false;
    // Apply clicked; cleared when Python reports a status
    this.listeners = [];
    const style = document.createElement("style");
    style.textContent = CSS;
    this.root = document.createElement("div");
    this.root.className = "vpipe-editor";
    this.bar = document.createElement("div");
    this.bar.className = "vpipe-bar";
    this.stages = document.createElement("div");
    this.stages.className = "vpipe-stagebar";
    this.summary = document.createElement("div");
    this.summary.className = "vpipe-summary";
    const row = document.createElement("div");
    row.className = "vpipe-row";
    this.apply = document.createElement("button");
    this.apply.textContent = "Apply";
    this.apply.dataset.testid = "apply";
    this.reset = document.createElement("button");
    this.reset.textContent = "Reset";
    this.reset.dataset.testid = "reset";
    this.schedule = document.createElement("select");
    this.schedule.dataset.testid = "schedule";
    this.schedule.title = "the draft's schedule: Apply runs it from the next iteration (a schedule with other chunks starts from an even cut)";
    this.status = document.createElement("span");
    this.status.className = "vpipe-status";
    this.status.dataset.testid = "status";
    row.append(this.schedule, this.apply, this.reset, this.status);
    this.grids = document.createElement("details");
    this.grids.className = "vpipe-grids";
    this.grids.dataset.testid = "grids";
    const title = document.createElement("summary");
    title.textContent = "schedule grid (each rank's actions by step, as torch prints a schedule)";
    this.gridRow = document.createElement("div");
    this.gridRow.className = "vpipe-gridrow";
    this.grids.append(title, this.gridRow);
    this.root.append(style, this.bar, this.summary, this.stages, row, this.grids);
    el.append(this.root);
    this.apply.addEventListener("click", () => this.onApply());
    this.reset.addEventListener("click", () => this.onReset());
    this.schedule.addEventListener("change", () => this.onSchedule());
    this.bar.addEventListener("pointermove", (e) => this.onMove(e));
    this.bar.addEventListener("pointerup", (e) => this.onUp(e));
    this.bar.addEventListener("pointercancel", () => {
      this.dragging = null;
      this.draw();
    });
    this.bar.addEventListener("lostpointercapture", () => {
      if (this.dragging) {
        this.dragging = null;
        this.draw();
      }
    });
    for (const name of [
      "layers",
      "boundaries",
      "policies",
      "stages",
      "placement",
      "schedule",
      "schedules",
      "draft_boundaries",
      "draft_policies",
      "draft_schedule",
      "draft_placement",
      "sharding",
      "draft_sharding",
      "preview",
      "status"
    ]) {
      const cb = () => {
        if (name.startsWith("draft_")) this.local = null;
        if (name === "status") this.pending = false;
        this.draw();
      };
      this.listeners.push([`change:${name}`, cb]);
      model.on(`change:${name}`, cb);
    }
    this.draw();
  }
  destroy() {
    for (const [event, cb] of this.listeners) this.model.off(event, cb);
    this.root.remove();
  }
  barWidth() {
    return this.width || this.bar.clientWidth || this.el.clientWidth || 800;
  }
  bounds() {
    return this.dragging ? this.dragging.bounds : this.draftBounds();
  }
  draftBounds() {
    return this.local?.boundaries ?? list(this.model, "draft_boundaries");
  }
  draftPolicies() {
    return this.local?.policies ?? list(this.model, "draft_policies");
  }
  /** Each stage's sharding in the draft (a sharded job; empty for whole devices). */
  draftSharding() {
    return this.local?.sharding ?? list(this.model, "draft_sharding");
  }
  /** What every message carries besides the partition: the schedule, and a sharded job's stages. */
  rest(schedule = this.draftSchedule(), sharding = this.draftSharding()) {
    return sharding.length ? { schedule, sharding } : { schedule };
  }
  draftSchedule() {
    return this.local?.schedule ?? this.model.get("draft_schedule") ?? this.model.get("schedule") ?? "";
  }
  ended() {
    return this.model.get("status")?.state === "ended";
  }
  send(message) {
    if (message.kind === "draft") {
      this.local = {
        boundaries: message.boundaries,
        policies: message.policies,
        schedule: message.schedule,
        sharding: message.sharding
      };
    }
    this.model.send(message);
  }
  edges() {
    if (this.dragging) return this.dragging.edges;
    return layerEdges(list(this.model, "layers").map((l) => l.weight), this.barWidth());
  }
  /** The ``i``-th element of ``pool`` (made by ``make`` the first time): blocks and handles are kept between draws,
   * so a change of size or place is a CSS transition, not a jump. Extra elements are removed. */
  reuse(pool, count, make) {
    while (pool.length < count) {
      const el = make(pool.length);
      pool.push(el);
      this.bar.append(el);
    }
    for (const extra of pool.splice(count)) extra.remove();
    return pool;
  }
  draw() {
    const layers = list(this.model, "layers");
    const bounds = this.bounds();
    const committed = list(this.model, "boundaries");
    const policies = this.draftPolicies();
    const applied = list(this.model, "policies");
    const edges = this.edges();
    this.bar.classList.toggle("dragging", this.dragging !== null);
    const blocks = this.reuse(this.blocks, layers.length, (i) => {
      const block = document.createElement("div");
      block.className = "vpipe-layer";
      block.dataset.testid = `layer-${i}`;
      block.addEventListener("click", () => this.onClick(i));
      return block;
    });
    const stages = Math.max(1, this.model.get("stages") ?? bounds.length - 1);
    const virtual = bounds.length - 1 > stages;
    const drafted = this.model.get("draft_placement") ?? [];
    const placement = drafted.length ? drafted : this.model.get("placement") ?? [];
    const stageOfChunk = (c) => placement[c] ?? c % stages;
    layers.forEach((layer, i) => {
      const block = blocks[i];
      const chunk = stageOf(i, bounds);
      const stage = stageOfChunk(chunk);
      const policy = policies[i] ?? "keep";
      block.classList.toggle("changed", chunk !== stageOf(i, committed) || policy !== (applied[i] ?? "keep"));
      block.dataset.policy = policy;
      block.dataset.stage = String(stage);
      block.dataset.chunk = String(chunk);
      block.style.left = `${edges[i] ?? 0}px`;
      block.style.width = `${(edges[i + 1] ?? 0) - (edges[i] ?? 0)}px`;
      block.style.background = stageColor(stage);
      block.style.opacity = virtual && Math.floor(chunk / stages) % 2 === 1 ? "0.7" : "";
      const width = (edges[i + 1] ?? 0) - (edges[i] ?? 0);
      block.replaceChildren(...blockLabel(layer, policy, width));
      block.title = `${layer.name}: stage ${stage}${virtual ? ` (chunk ${chunk})` : ""}, ${policy}` + (layer.forward_ms !== void 0 ? `, forward ${layer.forward_ms.toFixed(2)} ms` : "") + (layer.backward_ms !== void 0 ? `, backward ${layer.backward_ms.toFixed(2)} ms` : "") + (layer.activation_bytes !== void 0 ? `, activations ${formatBytes(layer.activation_bytes)}/mb` : "") + " (click to change keep/swap/recompute)";
    });
    const handles = this.reuse(this.handles, Math.max(0, bounds.length - 2), (h) => {
      const handle = document.createElement("div");
      handle.dataset.testid = `boundary-${h + 1}`;
      handle.addEventListener("pointerdown", (e) => this.onDown(e, h + 1));
      return handle;
    });
    handles.forEach((handle, h) => {
      const b = h + 1;
      handle.title = (virtual ? `boundary between chunk ${h} (stage ${stageOfChunk(h)}) and chunk ${b} (stage ${stageOfChunk(b)})` : `boundary between stage ${h} and stage ${b}`) + ": drag to move layers";
      handle.className = "vpipe-handle" + (this.dragging?.index === b ? " dragging" : "");
      handle.style.left = `${edges[bounds[b] ?? 0] ?? 0}px`;
      this.bar.append(handle);
    });
    this.drawSchedules();
    this.drawPreview();
    this.drawStatus();
  }
  drawSchedules() {
    const names = this.model.get("schedules") ?? [];
    const chosen = this.draftSchedule();
    const offered = names.includes(chosen) || !chosen ? names : [...names, chosen];
    if (!sameList(offered, Array.from(this.schedule.options, (o) => o.value))) {
      this.schedule.replaceChildren(...offered.map((name) => {
        const option = document.createElement("option");
        option.value = option.textContent = name;
        return option;
      }));
    }
    this.schedule.value = chosen;
    this.schedule.classList.toggle("changed", chosen !== (this.model.get("schedule") ?? ""));
  }
  drawPreview() {
    const preview = this.model.get("preview") ?? {};
    const dirty = this.isDirty();
    const shown = (dirty ? preview.draft : preview.current) ?? preview.current;
    this.summary.replaceChildren();
    this.stages.replaceChildren();
    this.drawGrids(preview, dirty);
    if (preview.error) {
      this.summary.textContent = `what-if: ${preview.error}`;
      return;
    }
    if (!shown) return;
    const awaiting = this.awaiting();
    this.stages.classList.toggle("stale", awaiting);
    const now = preview.current?.iteration_s ?? NaN;
    this.summary.textContent = awaiting ? "what-if: measuring the new draft..." : dirty && preview.draft ? `what-if: ${formatSeconds(preview.draft.iteration_s)} per iteration (now ${formatSeconds(now)}, ${((preview.draft.iteration_s - now) / now * 100).toFixed(1)}%)` + (preview.draft.feasible ? "" : " - does NOT fit in memory") : `predicted: ${formatSeconds(now)} per iteration`;
    this.summary.title = preview.calibration ? `calibrated ${preview.calibration}` : "simulated from the profile (not calibrated: too few measured iterations)";
    this.summary.dataset.testid = "summary";
    shown.peak_bytes.forEach((peak, s) => {
      const budget = shown.budget_bytes[s] ?? 0;
      const cell = document.createElement("div");
      cell.className = "vpipe-stage";
      const over = budget > 0 && peak > budget;
      cell.textContent = `stage ${s}: ${formatSeconds(shown.stage_s[s] ?? NaN)}/mb, ${formatBytes(peak)}` + (budget > 0 ? ` of ${formatBytes(budget)}` : "");
      const mode = this.draftSharding()[s];
      if (mode !== void 0) cell.append(this.shardingChip(s, mode));
      const track = document.createElement("div");
      track.className = "vpipe-mem";
      const fill = document.createElement("div");
      fill.style.width = `${Math.min(100, budget > 0 ? 100 * peak / budget : 0)}%`;
      fill.style.background = over ? "#E45756" : stageColor(s);
      track.append(fill);
      cell.append(track);
      this.stages.append(cell);
    });
  }
  /** Stage ``s``'s sharding in the draft: click to cycle it (a sharded job's stages only). */
  shardingChip(s, mode) {
    const chip = document.createElement("button");
    chip.className = "vpipe-sharding";
    chip.dataset.testid = `sharding-${s}`;
    chip.textContent = mode;
    chip.classList.toggle("changed", mode !== list(this.model, "sharding")[s]);
    chip.disabled = this.ended();
    chip.title = `stage ${s}'s shards: ${SHARDING_HELP[mode]} (click: hold -> regather -> scatter -> stream)`;
    chip.addEventListener("click", () => this.onSharding(s));
    return chip;
  }
  /** The running plan's grid, and the draft's beside it while there is one: text to read, CSV to download. */
  drawGrids(preview, dirty) {
    const shown = [["running", preview.current]];
    if (dirty) shown.push(["draft", preview.draft]);
    this.gridRow.replaceChildren(...shown.filter(([, est]) => est?.grid).map(([name, est]) => {
      const box = document.createElement("div");
      box.className = "vpipe-grid";
      box.dataset.testid = `grid-${name}`;
      const head = document.createElement("div");
      head.textContent = `${name} plan`;
      const link = document.createElement("a");
      link.textContent = "CSV";
      link.download = `schedule-${name}.csv`;
      link.href = `data:text/csv;charset=utf-8,${encodeURIComponent(est?.grid_csv ?? "")}`;
      link.dataset.testid = `grid-${name}-csv`;
      head.append(link);
      const pre = document.createElement("pre");
      pre.textContent = est?.grid ?? "";
      box.append(head, pre);
      return box;
    }));
  }
  drawStatus() {
    const reported = this.model.get("status") ?? { state: "idle", message: "" };
    const status = this.pending ? { state: "pending", message: "pending: waiting for the next iteration boundary" } : reported;
    const ended = status.state === "ended";
    this.root.classList.toggle("ended", ended);
    this.status.className = `vpipe-status ${status.state}`;
    this.status.textContent = status.message;
    this.apply.disabled = ended || !this.isDirty() || status.state === "pending";
    this.reset.disabled = ended || !this.isDirty();
    this.schedule.disabled = ended;
  }
  /** The draft's what-if the summary shows now (undefined while it shows none: no draft, awaiting, an error). */
  shownWhatIf() {
    const preview = this.model.get("preview") ?? {};
    const value = preview.draft?.iteration_s;
    return !preview.error && !this.awaiting() && this.isDirty() && value !== void 0 && value > 0 ? value : void 0;
  }
  /** A draft was sent and Python has not answered with it yet (it answers with the draft traits and their preview
   * together; a draft equal to the one it holds needs no answer). */
  awaiting() {
    return this.local !== null && !(sameList(this.local.boundaries, list(this.model, "draft_boundaries")) && sameList(this.local.policies, list(this.model, "draft_policies")) && (this.local.sharding === void 0 || sameList(this.local.sharding, list(this.model, "draft_sharding"))) && (this.local.schedule === void 0 || this.local.schedule === (this.model.get("draft_schedule") ?? "")));
  }
  isDirty() {
    return !sameList(this.draftBounds(), list(this.model, "boundaries")) || !sameList(this.draftPolicies(), list(this.model, "policies")) || !sameList(this.draftSharding(), list(this.model, "sharding")) || this.draftSchedule() !== (this.model.get("schedule") ?? this.draftSchedule());
  }
  x(e) {
    return e.clientX - this.bar.getBoundingClientRect().left;
  }
  onDown(e, index) {
    e.preventDefault();
    e.stopPropagation();
    if (this.ended()) return;
    this.dragging = { index, bounds: this.draftBounds().slice(), edges: this.edges() };
    try {
      this.bar.setPointerCapture(e.pointerId);
    } catch {
    }
    this.draw();
  }
  onMove(e) {
    if (!this.dragging) return;
    const target = nearestEdge(this.x(e), this.edges());
    const moved = moveBoundary(this.draftBounds(), this.dragging.index, target);
    if (!sameList(moved, this.dragging.bounds)) {
      this.dragging.bounds = moved;
      this.draw();
    }
  }
  onUp(e) {
    if (!this.dragging) return;
    this.onMove(e);
    const bounds = this.dragging.bounds;
    this.dragging = null;
    if (!sameList(bounds, this.draftBounds())) {
      this.send({ kind: "draft", boundaries: bounds, policies: this.draftPolicies(), ...this.rest() });
    }
    this.draw();
  }
  onClick(layer) {
    if (this.dragging || this.ended()) return;
    const policies = this.draftPolicies().slice();
    policies[layer] = cyclePolicy(policies[layer] ?? "keep");
    this.send({ kind: "draft", boundaries: this.draftBounds(), policies, ...this.rest() });
    this.draw();
  }
  onSharding(stage) {
    if (this.dragging || this.ended()) return;
    const sharding = this.draftSharding().slice();
    sharding[stage] = cycleSharding(sharding[stage] ?? "hold");
    this.send({
      kind: "draft",
      boundaries: this.draftBounds(),
      policies: this.draftPolicies(),
      ...this.rest(void 0, sharding)
    });
    this.draw();
  }
  onApply() {
    const shown = this.shownWhatIf();
    this.send({
      kind: "apply",
      boundaries: this.draftBounds(),
      policies: this.draftPolicies(),
      ...this.rest(),
      ...shown === void 0 ? {} : { shown_s: shown }
    });
    this.pending = true;
    this.draw();
  }
  onReset() {
    this.send({
      kind: "draft",
      boundaries: list(this.model, "boundaries").slice(),
      policies: list(this.model, "policies").slice(),
      ...this.rest(this.model.get("schedule") ?? this.draftSchedule(), list(this.model, "sharding").slice())
    });
    this.draw();
  }
  /** Another schedule chosen: Python re-cuts the draft when the schedule's chunks differ, and echoes it. */
  onSchedule() {
    if (this.ended()) return;
    this.send({
      kind: "draft",
      boundaries: this.draftBounds(),
      policies: this.draftPolicies(),
      ...this.rest(this.schedule.value)
    });
    this.draw();
  }
};

// src/index.ts
function render({ model, el }) {
  const view = new PartitionView(model, el);
  return () => view.destroy();
}
var index_default = { render };
export {
  index_default as default
};
