// The plotly.js the live dashboard draws with: the cartesian distribution (scatter, bar and the experts' load
// heatmap: 1.5 MB, not the full 4.8 MB; the basic one, 1.2 MB, has no heatmap),
// bundled as an ES module of its own and shipped gzipped beside live.js (static/plotly.js.gz). It is deliberately not
// part of live.js: anywidget gives a widget's module 2 s to load and initialize, and a model that misses that budget
// ignores every later message from Python; so live.js stays small and imports this in its view (loader.ts).
import Plotly from "plotly.js-cartesian-dist-min";

export default Plotly;
