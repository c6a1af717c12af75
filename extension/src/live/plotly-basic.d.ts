// plotly.js's basic distribution ships no type declarations; the live view describes what it uses (loader.ts).
declare module "plotly.js-basic-dist-min" {
  const Plotly: unknown;
  export default Plotly;
}
