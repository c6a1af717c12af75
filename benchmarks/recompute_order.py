"""Recompute in vPipe's order (each layer rebuilt right before its own backward) against the order before it (a
micro-batch's recomputed layers rebuilt together before its backward): peak activation memory and time per iteration.

    python benchmarks/recompute_order.py --before COMMIT [--rounds 5] [--iterations 6]

The earlier order lives only in the repository's history, so the script checks ``COMMIT`` out into a temporary
directory (``git worktree``) and runs the same job with each version in turn, alternating versions every round (these
machines drift). Each job: 2 CPU stages, M = 4, every layer recomputed, two warm-up iterations, then
``--iterations``; it reports each stage's peak of activation bytes as the engine's ledger counts them (the saved
tensors of kept layers, the saved inputs of recomputed ones, and what a rebuild holds) and the median iteration time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = """
import json, sys
import vpipe_lab
from vpipe_lab import Plan
name, layers, iterations = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
half = layers // 2
plan = Plan((0, half, layers), ("recompute",) * layers, 4, "1f1b")
with vpipe_lab.launch(name, stages=2, microbatches=4, plan=plan, device="cpu", timeout=120) as s:
    s.run(2 + iterations)
    s.wait(timeout=600)
    it = s.metrics.iterations
    mem = s.metrics.memory
    last = mem[mem["iteration"] >= 2]
    print(json.dumps({"ms": sorted(1e3 * it["time_s"].iloc[2:]),
                      "peak": [int(last[last.stage == k]["activations"].max()) for k in (0, 1)]}))
"""
MODELS = {"mlp": 10, "gpt-tiny": 8}


def run(source: Path, name: str, iterations: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(source), "VPIPE_LAB_ZYGOTE": "0"}
    out = subprocess.run([sys.executable, "-c", JOB, name, str(MODELS[name]), str(iterations)], env=env, cwd=source,
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a commit with the earlier recompute order")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True,
                       capture_output=True)
        try:
            print("| model | order | peak activations, stage 0 / 1 (MiB) | ms/it (median of rounds) |")
            print("|---|---|---|---|")
            for name in MODELS:
                got: dict[str, list[dict[str, list[float]]]] = {"together (before)": [], "each before its own": []}
                for r in range(args.rounds):
                    versions = [("together (before)", before), ("each before its own", ROOT)]
                    for label, source in versions if r % 2 == 0 else versions[::-1]:
                        got[label].append(run(source, name, args.iterations))
                for label, runs in got.items():
                    peaks = [max(x["peak"][k] for x in runs) / 2**20 for k in (0, 1)]
                    ms = statistics.median(statistics.median(x["ms"]) for x in runs)
                    print(f"| {name} | {label} | {peaks[0]:.2f} / {peaks[1]:.2f} | {ms:.1f} |", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False,
                           capture_output=True)


if __name__ == "__main__":
    main()
