"""How far to trust the what-if: the simulator's prediction for a live change (what the editor shows) against the
iteration time measured after applying it, per schedule, read from the session's own record (``session.history``).

    python benchmarks/what_if.py [--model gpt-tiny] [--iterations 30] [--shards 2] [--schedules 1f1b zb-h1]
                                 [--microbatches 4] [--change move|replan]

For each schedule a 2-stage session trains ``--iterations``, is profiled (the profile the editor's what-if uses),
and gets a partition change one layer off the even split; the change is recorded with the prediction made when it
was applied (``predicted_s``: the simulation calibrated by the running plan's recent iterations, what the editor
shows), and after ``--iterations`` more the record's median measured time gives the error; the plain simulation's
error is printed beside it. The plan the session started with is simulated from the same profile, for the error of
an unchanged plan. ``--shards 2`` runs each session as 2 stages x 2 sharded ranks (4 processes), its what-ifs
priced per rank with the collectives the cost model charges (``core/cost/sharded.py``). ``--change replan`` applies
what ``session.replan(apply=True)`` finds instead of the one-layer move; its "simulated" column is then the number
``replan`` returns (``Replan.predicted_s``, the planner's estimate).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import vpipe_lab
from vpipe_lab.core.cost.simulator import simulate

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"]  # interleaved and ZBV: 2 chunks a stage


def skewed(boundaries: tuple[int, ...]) -> list[int]:
    """One layer off the first cut."""
    bounds = list(boundaries)
    bounds[1] += 1 if bounds[2] - bounds[1] > 1 else -1
    return bounds


def one(model: str, schedule: str, iterations: int, shards: int = 1, microbatches: int = 4,
        change: str = "move") -> dict[str, Any]:
    with vpipe_lab.launch(model, stages=2, shards=shards, microbatches=microbatches, schedule=schedule, device="cpu",
                          timeout=120) as s:
        s.run(iterations)
        s.wait(timeout=600)
        if change == "replan":  # from a plan one layer off the even split: something for the planner to undo
            s.set_partition(tuple(skewed(s.plan.boundaries)))
            s.run(iterations)
            s.wait(timeout=600)
        profile = s.profile(reset=True)  # what the editor's what-if is computed from
        s.run(iterations)
        s.wait(timeout=600)
        profile = s.profile()
        start = simulate(s.plan, profile, s.cluster()).iteration_s
        if change == "replan":
            found = s.replan(apply=True, profile=profile)
            if found.applied_at is None:  # nothing to measure a prediction against
                return {"kept": found.plan.describe(), "start_measured_s": 0.0}
            simulated = found.predicted_s
        else:
            bounds = skewed(s.plan.boundaries)
            simulated = simulate(s.plan.with_boundaries(bounds), profile, s.cluster()).iteration_s  # uncalibrated
            s.set_partition(tuple(bounds))
        s.run(iterations)
        s.wait(timeout=600)
        rows = s.record.rows()
    first, changed = rows[0], rows[-1]
    return {"start_measured_s": first["median_s"], "start_predicted_s": start,
            "changed_measured_s": changed["median_s"], "changed_predicted_s": changed["predicted_s"],
            "changed_error": changed["error"], "changed_simulated_s": simulated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--shards", type=int, default=1, help="ranks sharding each stage (FSDP2)")
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--change", choices=("move", "replan"), default="move")
    args = ap.parse_args()
    print("| schedule | unchanged plan: measured / simulated (ms) | error | after the change: measured (ms) | "
          "simulated (ms) | error | calibrated, the what-if (ms) | error |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    errors, raw = [], []
    for schedule in args.schedules:
        r = one(args.model, schedule, args.iterations, args.shards, args.microbatches, args.change)
        if "kept" in r:
            print(f"| {schedule} | replan kept the plan in force ({r['kept']}) | | | | | | |", flush=True)
            continue
        before = r["start_measured_s"] / r["start_predicted_s"] - 1
        plain = r["changed_measured_s"] / r["changed_simulated_s"] - 1
        errors.append(abs(r["changed_error"]))
        raw.append(abs(plain))
        print(f"| {schedule} | {1e3 * r['start_measured_s']:.1f} / {1e3 * r['start_predicted_s']:.1f} | {before:+.1%} "
              f"| {1e3 * r['changed_measured_s']:.1f} | {1e3 * r['changed_simulated_s']:.1f} | {plain:+.1%} | "
              f"{1e3 * r['changed_predicted_s']:.1f} | {r['changed_error']:+.1%} |", flush=True)
    print(f"\nmedian |error| after a change: simulated {statistics.median(raw):.1%} (largest {max(raw):.1%}), "
          f"calibrated {statistics.median(errors):.1%} (largest {max(errors):.1%})")


if __name__ == "__main__":
    main()
