// The partition editor's messages from the browser to Python, written once: this JSON schema is the contract.
// TypeScript derives the message types from it (json-schema-to-ts); `npm run bundle` writes it next to the bundle as
// vpipe_lab/jupyter/static/editor_messages.schema.json, which Python validates every incoming message against.
import type { FromSchema } from "json-schema-to-ts";
import { POLICIES, SHARDINGS } from "./vocabulary";

const boundaries = { type: "array", items: { type: "integer", minimum: 0 }, minItems: 2, maxItems: 4096 } as const;
const policies = {
  type: "array", items: { type: "string", enum: POLICIES }, maxItems: 4096,
} as const;
// A sharded job's stages: when each one's shards gather and reduce. Absent: the draft's as Python holds it.
const sharding = {
  description: "each stage's sharding (a sharded job only: one per stage)",
  type: "array", items: { type: "string", enum: SHARDINGS }, minItems: 1, maxItems: 4096,
} as const;
// Any schedule the Python process registered (its own names included), so a name, not the built-in list.
const schedule = {
  description: "the draft's schedule (one of the editor's `schedules` trait); another one than the draft's re-cuts " +
    "the boundaries in Python when its chunks differ",
  type: "string", minLength: 1, maxLength: 100,
} as const;

// The what-if the page showed for this draft as Apply was clicked: the session records it as the change's prediction.
// Python already sent it (the draft's preview); the page names which of those numbers the user saw, since Python may
// have sent a newer one that had not reached the page yet. Absent where the page showed no number for the draft.
const shown_s = {
  description: "the draft's what-if (seconds per iteration) the page showed when Apply was clicked",
  type: "number", exclusiveMinimum: 0,
} as const;

export const EDITOR_MESSAGES = {
  $schema: "https://json-schema.org/draft/2020-12/schema",
  title: "vpipe_lab partition editor message",
  oneOf: [
    {
      description: "the user changed the draft (a boundary dropped after a drag, a policy or a sharding clicked, Reset)",
      type: "object",
      properties: { kind: { const: "draft" }, boundaries, policies, schedule, sharding },
      required: ["kind", "boundaries", "policies"],
      additionalProperties: false,
    },
    {
      description: "apply this draft to the running session (live migration at the next iteration boundary)",
      type: "object",
      properties: { kind: { const: "apply" }, boundaries, policies, schedule, sharding, shown_s },
      required: ["kind", "boundaries", "policies"],
      additionalProperties: false,
    },
  ],
} as const;

export type EditorMessage = FromSchema<typeof EDITOR_MESSAGES>;
export type DraftMessage = Extract<EditorMessage, { kind: "draft" }>;
export type ApplyMessage = Extract<EditorMessage, { kind: "apply" }>;
