"""What restarts cost: training with snapshots (``launch(max_restarts=1)``) against the same job without, and a restart.

    python benchmarks/snapshots.py [--blocks 6] [--iterations 40]

Per job, two sessions are started and trained in alternating blocks of ``--iterations`` (one runs while the other
waits, so both see the same machine); the overhead is the ratio of their median wall time per iteration over the
blocks (snapshots chosen by the workers to cost at most ~5%: ``runtime/disk/snapshots.py``). At each block's end the
distance from the newest complete snapshot to the iteration reached is sampled: the iterations a failure then would
replay. Last, a worker of the snapshotting session is SIGKILLed and the restart measured (seconds from the failure
being named to training again, iterations replayed) and training checked to go on.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from fused_wgrad import adamw, gpt2, gpt2_data, lm_loss

import vpipe_lab
from vpipe_lab.wire import snapshot_format

JOBS: dict[str, dict[str, Any]] = {
    "mlp (bundled)": {"model": "mlp", "microbatches": 4},
    "gpt-tiny (bundled)": {"model": "gpt-tiny", "microbatches": 4},
    "gpt2-512 (HuggingFace)": {"model": gpt2, "data": gpt2_data, "loss": lm_loss, "optimizer": adamw,
                               "microbatches": 4},
}


def block(session: vpipe_lab.Session, iterations: int) -> float:
    """Seconds per iteration over ``iterations`` more."""
    start = time.perf_counter()
    session.run(iterations)
    session.wait(timeout=600)
    return (time.perf_counter() - start) / iterations


def measure(job: dict[str, Any], blocks: int, iterations: int) -> dict[str, Any]:
    plain = vpipe_lab.launch(stages=2, device="cpu", timeout=120, **job)
    snapped = vpipe_lab.launch(stages=2, device="cpu", timeout=120, max_restarts=1, **job)
    try:
        block(plain, 5)  # warm-up: captures, first profiles, the first snapshot
        block(snapped, 5)
        times: dict[str, list[float]] = {"plain": [], "snapshots": []}
        behind: list[int] = []
        root = Path(str(snapped.spec.snapshot_dir))
        for _ in range(blocks):
            times["plain"].append(block(plain, iterations))
            times["snapshots"].append(block(snapped, iterations))
            found = snapshot_format.newest(root, snapped.stages)
            behind.append(snapped.iteration - (found[1].iteration if found else 0))
        snapped.run(None)
        snapped.wait(snapped.iteration + 3, timeout=120)
        killed_at = snapped.iteration
        os.kill(snapped.processes.pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not snapped.processes.restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        snapped.wait(killed_at + 3, timeout=120)  # the lost iterations replayed, and training went on
        restart = snapped.processes.restarts[0]
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        return {"plain_ms": ms["plain"], "snap_ms": ms["snapshots"], "ratio": ms["snapshots"] / ms["plain"],
                "behind": statistics.mean(behind), "restart_s": restart["seconds"], "replayed": restart["replayed"],
                "loss_diff": restart["loss_diff"]}
    finally:
        plain.stop()
        snapped.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--only", help="one job's name prefix")
    args = ap.parse_args()
    print("| job | ms/iteration without | with snapshots | ratio | iterations behind the newest snapshot (mean) "
          "| a restart: seconds | replayed | replayed loss difference |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, job in JOBS.items():
        if args.only and not name.startswith(args.only):
            continue
        r = measure(job, args.blocks, args.iterations)
        print(f"| {name} | {r['plain_ms']:.1f} | {r['snap_ms']:.1f} | {r['ratio']:.3f} | {r['behind']:.1f} | "
              f"{r['restart_s']:.2f} | {r['replayed']} | {r['loss_diff']} |", flush=True)


if __name__ == "__main__":
    main()
