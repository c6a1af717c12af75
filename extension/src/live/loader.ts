// Loads plotly.js for the live dashboard from the bytes Python ships with the widget (gzipped ES module), once per
// page: every dashboard on the page shares the first one's module, whatever order they render in.

/** The part of plotly.js the live view uses. */
export interface PlotlyLike {
  react(el: HTMLElement, data: unknown[], layout: Record<string, unknown>, config?: Record<string, unknown>): Promise<unknown>;
  purge(el: HTMLElement): void;
  Plots: { resize(el: HTMLElement): unknown };
}

const CACHE_KEY = "__vpipeLabPlotly";

/** A binary trait as anywidget hands it over (a DataView, or an ArrayBuffer / typed array in other hosts). */
export function bytesOf(value: unknown): Uint8Array {
  if (value instanceof Uint8Array) return value;
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  throw new TypeError(`expected binary data for plotly.js, got ${Object.prototype.toString.call(value)}`);
}

/** Text of gzipped bytes, with the browser's own decompressor. */
export async function gunzipText(bytes: Uint8Array): Promise<string> {
  const copy = new Uint8Array(bytes.byteLength);
  copy.set(bytes);
  const stream = new Blob([copy.buffer]).stream().pipeThrough(new DecompressionStream("gzip"));
  return await new Response(stream).text();
}

/** Import an ES module from its source text. */
export async function importSource(source: string): Promise<unknown> {
  const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
  try {
    const module = (await import(/* @vite-ignore */ url)) as { default?: unknown };
    return module.default;
  } finally {
    URL.revokeObjectURL(url);
  }
}

function cache(): Map<string, Promise<PlotlyLike>> {
  const scope = globalThis as unknown as Record<string, Map<string, Promise<PlotlyLike>> | undefined>;
  return (scope[CACHE_KEY] ??= new Map());
}

/** plotly.js built from ``bytes()`` (read only the first time ``key`` is asked for on this page). */
export function loadPlotly(
  key: string, bytes: () => Uint8Array,
  load: (bytes: Uint8Array) => Promise<unknown> = async (b) => await importSource(await gunzipText(b)),
): Promise<PlotlyLike> {
  const known = cache();
  let pending = known.get(key);
  if (pending === undefined) {
    pending = load(bytes()).then((plotly) => {
      if (typeof (plotly as Partial<PlotlyLike> | null)?.react !== "function") {
        throw new TypeError("the shipped plotly.js has no react(): the bundle is broken (rebuild extension/)");
      }
      return plotly as PlotlyLike;
    });
    known.set(key, pending);
    pending.catch(() => known.delete(key)); // a failed load may be retried by the next view
  }
  return pending;
}

/** Forget every loaded plotly.js (tests). */
export function clearPlotlyCache(): void {
  cache().clear();
}
