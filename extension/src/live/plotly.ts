// The plotly.js the live dashboard draws with: the basic distribution (scatter and bar: 1.2 MB, not the full 4.8 MB),
// bundled as an ES module of its own and shipped gzipped beside live.js (static/plotly.js.gz). It is deliberately not
// part of live.js: anywidget gives a widget's module 2 s to load and initialize, and a model that misses that budget
// ignores every later message from Python; so live.js stays small and imports this in its view (loader.ts).
import Plotly from "plotly.js-basic-dist-min";

export default Plotly;
