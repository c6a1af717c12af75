// anywidget entry point of vpipe_lab's live dashboard. It stays small on purpose: anywidget gives a module 2 s to
// load and initialize before it stops passing the model Python's messages, so plotly.js (shipped gzipped in the
// `_plotly` trait) is imported by the view, after that window, once per page (loader.ts).
import { bytesOf, loadPlotly } from "./loader";
import { LiveView, type LiveModel } from "./view";

function render({ model, el }: { model: LiveModel; el: HTMLElement }): () => void {
  const plotly = loadPlotly(String(model.get("_plotly_key") ?? ""), () => bytesOf(model.get("_plotly")));
  const view = new LiveView(model, el, plotly);
  return () => view.destroy();
}

export default { render };
