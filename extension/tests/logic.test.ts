import { describe, expect, it } from "vitest";
import {
  SHARDINGS, SHARDING_HELP, boundaryRange, cyclePolicy, cycleSharding, formatBytes, formatSeconds, layerEdges, moveBoundary, nearestEdge, sameList, stageColor,
  stageOf,
} from "../src/logic";

describe("policies", () => {
  it("cycles keep -> swap -> recompute -> keep", () => {
    expect(cyclePolicy("keep")).toBe("swap");
    expect(cyclePolicy("swap")).toBe("recompute");
    expect(cyclePolicy("recompute")).toBe("keep");
    expect(cyclePolicy("bogus")).toBe("keep");
  });
});

describe("shardings", () => {
  it("cycles hold -> regather -> scatter -> stream -> hold, each with its hover help", () => {
    expect(["hold", "regather", "scatter", "stream", "bogus"].map(cycleSharding))
      .toEqual(["regather", "scatter", "stream", "hold", "hold"]);
    expect(SHARDINGS.every((m) => SHARDING_HELP[m].length > 20)).toBe(true);
  });
});

describe("boundaries", () => {
  const bounds = [0, 3, 5, 10];
  it("finds the owner of every layer", () => {
    expect([0, 2, 3, 4, 5, 9].map((l) => stageOf(l, bounds))).toEqual([0, 0, 1, 1, 2, 2]);
    expect(stageOf(10, bounds)).toBe(-1);
  });
  it("moves an interior boundary and keeps every stage non-empty", () => {
    expect(moveBoundary(bounds, 1, 1)).toEqual([0, 1, 5, 10]);
    expect(moveBoundary(bounds, 1, 9)).toEqual([0, 4, 5, 10]); // clamped: stage 1 keeps layer 4
    expect(moveBoundary(bounds, 2, 0)).toEqual([0, 3, 4, 10]);
    expect(moveBoundary(bounds, 2, 7.4)).toEqual([0, 3, 7, 10]);
    expect(bounds).toEqual([0, 3, 5, 10]); // pure
  });
  it("refuses the outer boundaries", () => {
    expect(() => boundaryRange(bounds, 0)).toThrow(RangeError);
    expect(() => moveBoundary(bounds, 3, 4)).toThrow(/not movable/);
  });
});

describe("geometry", () => {
  it("lays layers out by weight with a minimum width", () => {
    const edges = layerEdges([1, 1, 2], 400, 10);
    expect(edges[0]).toBe(0);
    expect(edges[3]).toBeCloseTo(400);
    expect((edges[3] ?? 0) - (edges[2] ?? 0)).toBeCloseTo(10 + 370 / 2);
    const tiny = layerEdges([0, 0, 1000], 300, 12);
    expect((tiny[1] ?? 0) - (tiny[0] ?? 0)).toBeCloseTo(12);
  });
  it("snaps to the nearest edge", () => {
    expect(nearestEdge(47, [0, 40, 100, 160])).toBe(1);
    expect(nearestEdge(128, [0, 40, 100, 160])).toBe(2);
    expect(nearestEdge(131, [0, 40, 100, 160])).toBe(3);
    expect(nearestEdge(-5, [0, 40])).toBe(0);
  });
});

describe("formatting", () => {
  it("formats bytes, seconds and colours", () => {
    expect(formatBytes(3 * 2 ** 30)).toBe("3.00 GiB");
    expect(formatBytes(512)).toBe("512 B");
    expect(formatSeconds(0.0123)).toBe("12.30 ms");
    expect(formatSeconds(2)).toBe("2.000 s");
    expect(formatSeconds(NaN)).toBe("n/a");
    expect(stageColor(8)).toBe(stageColor(0));
    expect(sameList([1, 2], [1, 2])).toBe(true);
    expect(sameList([1, 2], [2, 1])).toBe(false);
  });
});
