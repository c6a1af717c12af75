"""Memory over a long run: the controller's and each worker's resident memory against iterations trained.

    python benchmarks/flat_memory.py --minutes 5 [--model gpt-tiny] [--stages 2] [--trace] [--heap]

A session trains without end; every ``--every`` seconds the controller (this process) and each worker are sampled
(RSS, from /proc through psutil) with the iteration count. After a warm-up (the first quarter of the samples) the
growth is the least-squares slope of RSS against iterations: bytes kept per iteration, and what that makes per hour
at the measured rate. ``--trace`` also runs tracemalloc in this process and prints the lines that gained the most
between the end of the warm-up and the end (what the controller keeps). ``--heap`` has each worker log a heap census
(``runtime/heap.py``) every ``--every`` seconds and fits the same slope to what malloc has handed out and to Python's
object count: growth of those is memory kept, RSS growing alone is fragmentation. Run it at two commits to compare.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
import tracemalloc

import psutil

import vpipe_lab


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


CENSUS = re.compile(r"heap census: iteration=(-?\d+) (.*)$")


def censuses(log_path: str) -> list[dict[str, int]]:
    """The heap census lines of one worker's log, each as its numbers (``iteration`` included)."""
    rows = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if m := CENSUS.search(line):
                parts = dict(kv.split("=", 1) for kv in m.group(2).split())
                rows.append({"iteration": int(m.group(1)), **{k: int(v) for k, v in parts.items()}})
    return rows


def heap_slopes(rank: int, rows: list[dict[str, int]]) -> None:
    """Print the per-iteration slope of each census quantity after the first quarter of the lines."""
    after = rows[len(rows) // 4:]
    if len(after) < 3:
        print(f"  worker {rank}: {len(rows)} census lines, too few for a slope")
        return
    its = [float(r["iteration"]) for r in after]
    parts = []
    for key in ("rss", "malloc_used", "malloc_free", "py_objects", "threads", "garbage"):
        parts.append(f"{key} {slope(its, [float(r[key]) for r in after]):+.2f}/it")
    print(f"  worker {rank} census ({len(after)} lines, {after[0]['malloc_used'] / 2**20:.1f} -> "
          f"{after[-1]['malloc_used'] / 2**20:.1f} MiB in use): " + ", ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--trace", action="store_true", help="tracemalloc the controller")
    ap.add_argument("--heap", action="store_true", help="workers log a heap census (malloc in use, Python objects)")
    args = ap.parse_args()
    if args.heap:
        os.environ["VPIPE_LAB_HEAP_LOG"] = str(args.every)  # the workers take the controller's environment
    if args.trace:
        tracemalloc.start(8)
    me = psutil.Process()
    samples: list[tuple[int, int, list[int]]] = []  # (iteration, controller RSS, worker RSS by rank)
    with vpipe_lab.launch(args.model, stages=args.stages, microbatches=args.microbatches, device="cpu",
                          timeout=120) as s:
        workers = [psutil.Process(pid) for _, pid in sorted(s.processes.pids().items())]
        logs = [os.readlink(f"/proc/{w.pid}/fd/2") for w in workers]  # each worker's stderr is its log file
        s.run(None)
        start = time.monotonic()
        warm = None
        while time.monotonic() - start < args.minutes * 60:
            time.sleep(args.every)
            samples.append((s.iteration, me.memory_info().rss, [w.memory_info().rss for w in workers]))
            if args.trace and warm is None and len(samples) >= max(2, int(args.minutes * 60 / args.every / 4)):
                warm = tracemalloc.take_snapshot()
        s.pause()
        heaps = [censuses(path) for path in logs] if args.heap else []
        if args.trace and warm is not None:
            grown = tracemalloc.take_snapshot().compare_to(warm, "lineno")
            print("controller: the lines that gained the most since the warm-up")
            for stat in grown[:12]:
                print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  {stat.traceback}")
    rate = (samples[-1][0] - samples[0][0]) / (args.minutes * 60)
    after = samples[len(samples) // 4:]
    its = [float(it) for it, _, _ in after]
    print(f"{args.model}, {args.stages} stages, M={args.microbatches}: {samples[-1][0]} iterations in "
          f"{args.minutes:g} min ({rate:.1f}/s), {len(samples)} samples every {args.every:g} s, slope after the first "
          f"{len(samples) - len(after)} samples")
    rows = [("controller", [c for _, c, _ in after])] + [
        (f"worker {r}", [w[r] for _, _, w in after]) for r in range(len(after[0][2]))]
    for name, rss in rows:
        per_it = slope(its, [float(v) for v in rss])
        print(f"  {name:10s} RSS {rss[0] / 2**20:7.1f} -> {rss[-1] / 2**20:7.1f} MiB, {per_it:+8.1f} B/iteration "
              f"({per_it * rate * 3600 / 2**20:+7.1f} MiB/hour at this rate)")
    for rank, rows_ in enumerate(heaps):
        heap_slopes(rank, rows_)


if __name__ == "__main__":
    main()
