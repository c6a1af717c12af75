// Generated from Python by `python -m vpipe_lab.core.vocabulary` (core/vocabulary.py); do not edit by hand.

export const POLICIES = ["keep", "swap", "recompute"] as const;
export const SCHEDULES = ["gpipe", "1f1b", "eager-1f1b", "zb-h1", "interleaved-1f1b", "zbv", "dualpipev", "pipedream"] as const;
export const SHARDINGS = ["hold", "regather", "scatter", "stream"] as const;
