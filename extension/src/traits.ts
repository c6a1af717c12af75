// What Python's widgets hold and the browser reads, declared once: a JSON schema per widget for its synced traits.
// TypeScript derives the views' model types from it (json-schema-to-ts), so a view reads `model.get("status")` as
// the declared type, not `unknown`; `npm run bundle` writes it to vpipe_lab/jupyter/static/widget_traits.schema.json,
// and Python's tests check that each widget's synced traits are exactly these, with values that validate.
import type { FromSchema } from "json-schema-to-ts";
import { POLICIES, SHARDINGS } from "./vocabulary";

const ints = { type: "array", items: { type: "integer", minimum: 0 } } as const;
const numbers = { type: "array", items: { type: "number" } } as const;
const policies = { type: "array", items: { type: "string", enum: POLICIES } } as const;
const sharding = {
  description: "each stage's sharding (when its shards gather and reduce, core/sharding.py); empty: whole devices",
  type: "array", items: { type: "string", enum: SHARDINGS },
} as const;
const estimate = {
  type: "object",
  properties: {
    iteration_s: { description: "the what-if: the simulated iteration, calibrated when the running plan was measured",
      type: "number" },
    simulated_s: { description: "the simulator's iteration under the profile, before calibration", type: "number" },
    stage_s: numbers, peak_bytes: numbers, budget_bytes: numbers,
    feasible: { type: "boolean" },
    grid: { description: "the schedule grid as torch's _format_pipeline_order prints it (core/interop/torch_grid.py)",
      type: "string" },
    grid_csv: { description: "the same grid as CSV: a step column, a column per rank", type: "string" },
  },
  required: ["iteration_s", "stage_s", "peak_bytes", "budget_bytes", "feasible"],
  additionalProperties: false,
} as const;
const figure = {
  description: "one plotly figure, whole (Python's charts module builds it)",
  type: "object",
  properties: { data: { type: "array", items: { type: "object" } }, layout: { type: "object" } },
  additionalProperties: true,
} as const;

export const EDITOR_TRAITS = {
  title: "the partition editor's traits (PartitionEditor, jupyter/partition_widget.py)",
  type: "object",
  properties: {
    layers: {
      type: "array",
      items: {
        type: "object",
        properties: {
          name: { type: "string" }, weight: { type: "number" }, forward_ms: { type: "number" },
          backward_ms: { type: "number" },
          activation_bytes: { description: "what the layer keeps for its backward, per micro-batch", type: "number" },
        },
        required: ["name", "weight"],
        additionalProperties: false,
      },
    },
    boundaries: ints,
    stages: {
      description: "the stages (devices); with more chunks than stages (virtual stages) chunk c runs on stage " +
        "placement[c] (looped, c % stages, when placement is empty)",
      type: "integer", minimum: 1,
    },
    placement: {
      description: "the stage of each chunk (ZBV: down the stages and back up); empty: chunk c on stage c % stages",
      type: "array", items: { type: "integer", minimum: 0 },
    },
    policies,
    schedule: { description: "the running plan's schedule", type: "string" },
    schedules: {
      description: "the schedules the Python process knows (its registry, user-registered ones included)",
      type: "array", items: { type: "string" },
    },
    draft_boundaries: ints,
    draft_policies: policies,
    draft_schedule: { type: "string" },
    draft_placement: {
      description: "the stage of each of the draft's chunks (its schedule's placement)",
      type: "array", items: { type: "integer", minimum: 0 },
    },
    sharding,
    draft_sharding: sharding,
    preview: {
      type: "object",
      properties: {
        current: estimate, draft: estimate, error: { type: "string" },
        calibration: { description: "how the simulation was scaled to the running plan's recent measured iterations",
          type: "string" },
      },
      additionalProperties: false,
    },
    status: {
      type: "object",
      properties: {
        state: { type: "string", enum: ["idle", "pending", "applied", "error", "ended"] },
        message: { type: "string" },
        iteration: { type: "integer" },
      },
      required: ["state", "message"],
      additionalProperties: false,
    },
  },
  required: ["layers", "boundaries", "stages", "policies", "schedule", "schedules", "draft_boundaries", "draft_policies",
    "draft_schedule", "draft_placement", "sharding", "draft_sharding", "preview", "status"],
  additionalProperties: false,
} as const;

export const LIVE_TRAITS = {
  title: "the live dashboard's traits (LiveView, jupyter/live_view.py)",
  type: "object",
  properties: {
    _plotly: { description: "plotly.js, gzipped: bytes, which JSON schema cannot type (checked in Python)" },
    _plotly_key: { type: "string" },
    header: {
      type: "object",
      properties: { state: { type: "string" }, text: { type: "string" }, detail: { type: "string" } },
      required: ["state", "text"],
      additionalProperties: false,
    },
    timeline: figure,
    memory: figure,
    series: figure,
    experts: figure,
    frame: { type: "integer", minimum: 0 },
    role: {
      description: "what the view is: the dashboard, the editor's what-if, or the history panel's comparison",
      type: "string", enum: ["dashboard", "what-if", "history"],
    },
  },
  required: ["_plotly", "_plotly_key", "header", "timeline", "memory", "series", "experts", "frame", "role"],
  additionalProperties: false,
} as const;

export const WIDGET_TRAITS = {
  $schema: "https://json-schema.org/draft/2020-12/schema",
  title: "vpipe_lab widget traits",
  $defs: { PartitionEditor: EDITOR_TRAITS, LiveView: LIVE_TRAITS },
} as const;

// One type per trait, from its own schema (a whole-object FromSchema is too deep for the compiler).
type Traits<S extends { properties: Record<string, unknown> }> = {
  [K in keyof S["properties"]]: FromSchema<S["properties"][K] & object>;
};
export type EditorTraits = Traits<typeof EDITOR_TRAITS>;
export type LiveTraits = Omit<Traits<typeof LIVE_TRAITS>, "_plotly"> & { _plotly: unknown };

/** The part of anywidget's model a view uses, typed by its traits (the tests fake it). */
export interface TypedModel<T> {
  get<K extends keyof T & string>(name: K): T[K];
  on(event: string, callback: () => void): void;
  off(event?: string | null, callback?: (() => void) | null): void;
}
