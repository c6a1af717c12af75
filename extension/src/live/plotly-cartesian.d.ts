// plotly.js's cartesian distribution ships no type declarations; the live view describes what it uses (loader.ts).
declare module "plotly.js-cartesian-dist-min" {
  const Plotly: unknown;
  export default Plotly;
}
