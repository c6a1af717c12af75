// Pure logic of the partition editor: boundaries, policies, geometry, formatting. No DOM here.

import { POLICIES as PYTHON_POLICIES, SHARDINGS as PYTHON_SHARDINGS } from "./vocabulary";

export type Policy = (typeof PYTHON_POLICIES)[number];
export const POLICIES: readonly Policy[] = PYTHON_POLICIES; // Python's words (src/vocabulary.ts is generated)
export type Sharding = (typeof PYTHON_SHARDINGS)[number];
export const SHARDINGS: readonly Sharding[] = PYTHON_SHARDINGS;

/** What each sharding does, for its chip's hover title (core/sharding.py says it at length). */
export const SHARDING_HELP: Record<Sharding, string> = {
  hold: "gather the parameters once, reduce the gradients once per iteration (the most memory; torchtitan's PP layout)",
  regather: "gather each unit before every forward and backward, reduce once per iteration",
  scatter: "gather once, reduce-scatter the gradients after every micro-batch",
  stream: "gather and reduce every micro-batch (the least memory, the most collectives)",
};

/** hold -> regather -> scatter -> stream -> hold (anything unknown starts over at hold). */
export function cycleSharding(m: string): Sharding {
  const i = SHARDINGS.indexOf(m as Sharding);
  return SHARDINGS[(i + 1) % SHARDINGS.length] ?? "hold";
}

/** keep -> swap -> recompute -> keep (anything unknown starts over at keep). */
export function cyclePolicy(p: string): Policy {
  const i = POLICIES.indexOf(p as Policy);
  return POLICIES[(i + 1) % POLICIES.length] ?? "keep";
}

/** The stage that owns ``layer`` under ``bounds`` (stage s owns bounds[s] .. bounds[s+1]-1). */
export function stageOf(layer: number, bounds: readonly number[]): number {
  for (let s = 0; s + 1 < bounds.length; s++) {
    if (layer >= (bounds[s] ?? 0) && layer < (bounds[s + 1] ?? 0)) return s;
  }
  return -1;
}

/** Where interior boundary ``index`` (1 .. K-1) may go: every stage keeps at least one layer. */
export function boundaryRange(bounds: readonly number[], index: number): [number, number] {
  if (index <= 0 || index >= bounds.length - 1) throw new RangeError(`boundary ${index} is not movable`);
  return [(bounds[index - 1] ?? 0) + 1, (bounds[index + 1] ?? 0) - 1];
}

/** ``bounds`` with boundary ``index`` moved to ``target``, clamped so no stage goes empty. */
export function moveBoundary(bounds: readonly number[], index: number, target: number): number[] {
  const [lo, hi] = boundaryRange(bounds, index);
  const out = bounds.slice();
  out[index] = Math.min(hi, Math.max(lo, Math.round(target)));
  return out;
}

/** Pixel x of every layer edge (L + 1 of them): widths follow ``weights``, each at least ``minWidth``. */
export function layerEdges(weights: readonly number[], width: number, minWidth = 12): number[] {
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

/** The layer edge nearest to pixel ``x``. */
export function nearestEdge(x: number, edges: readonly number[]): number {
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

export function sameList<T>(a: readonly T[], b: readonly T[]): boolean {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

export function formatBytes(n: number): string {
  const units: [string, number][] = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [unit, size] of units) if (Math.abs(n) >= size) return `${(n / size).toFixed(2)} ${unit}`;
  return `${Math.round(n)} B`;
}

export function formatSeconds(s: number): string {
  if (!Number.isFinite(s)) return "n/a";
  if (s >= 1) return `${s.toFixed(3)} s`;
  return `${(s * 1e3).toFixed(2)} ms`;
}

/** Stage colours (colour-blind-friendly palette, cycling). */
export const STAGE_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#EECA3B", "#9D755D"];

export function stageColor(stage: number): string {
  return STAGE_COLORS[((stage % STAGE_COLORS.length) + STAGE_COLORS.length) % STAGE_COLORS.length] ?? "#888";
}
