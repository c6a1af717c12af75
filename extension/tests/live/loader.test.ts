import { afterEach, describe, expect, it } from "vitest";
import { bytesOf, clearPlotlyCache, gunzipText, loadPlotly } from "../../src/live/loader";

const fakePlotly = { react: async () => undefined, purge: () => undefined, Plots: { resize: () => undefined } };

afterEach(() => clearPlotlyCache());

describe("bytesOf", () => {
  it("takes what anywidget hands over for a binary trait", () => {
    const raw = new Uint8Array([1, 2, 3, 4]);
    expect([...bytesOf(new DataView(raw.buffer, 1, 2))]).toEqual([2, 3]);
    expect([...bytesOf(raw.buffer)]).toEqual([1, 2, 3, 4]);
    expect(bytesOf(raw)).toBe(raw);
    expect(() => bytesOf("not bytes")).toThrow(/binary data/);
  });
});

describe("gunzipText", () => {
  it("decompresses with the browser's own decompressor", async () => {
    const stream = new Blob(["hello plotly"]).stream().pipeThrough(new CompressionStream("gzip"));
    const gz = new Uint8Array(await new Response(stream).arrayBuffer());
    expect(await gunzipText(gz)).toBe("hello plotly");
  });
});

describe("loadPlotly", () => {
  it("loads once per page and key: later views reuse the first one's module and never read the bytes", async () => {
    let loads = 0;
    let reads = 0;
    const load = async (): Promise<unknown> => { loads += 1; return fakePlotly; };
    const bytes = (): Uint8Array => { reads += 1; return new Uint8Array(); };
    const [a, b] = await Promise.all([loadPlotly("k1", bytes, load), loadPlotly("k1", bytes, load)]);
    expect(a).toBe(fakePlotly);
    expect(b).toBe(a);
    expect([loads, reads]).toEqual([1, 1]);
    await loadPlotly("k2", bytes, load); // another plotly.js version is loaded on its own
    expect(loads).toBe(2);
  });

  it("rejects a bundle without react() and lets the next view try again", async () => {
    await expect(loadPlotly("bad", () => new Uint8Array(), async () => ({}))).rejects.toThrow(/no react/);
    expect(await loadPlotly("bad", () => new Uint8Array(), async () => fakePlotly)).toBe(fakePlotly);
  });
});
