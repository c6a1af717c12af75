"""What running part of a model eagerly costs: the same model traced whole, and with a module class run eagerly inside
its units (as DBRX's experts and Gemma-3n's layers must be, ``runtime/model/trace/eager.py``), side by side in one run.

    python benchmarks/eager.py [--model mixtral] [--eager MixtralSparseMoeBlock] [--iterations 20] [--rounds 3]

Each round launches both (2 stages, 4 micro-batches, one after the other, alternating which goes first) and takes the
median iteration of the last ``iterations - 3``; prints each round's times, peaks per stage and the eager/traced ratios.
The two runs' losses must agree (the same arithmetic): the script says whether they do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vpipe_lab
from tests.models.zoo import ZOO


def run(name: str, iterations: int, eager: str | None) -> tuple[float, list[int], list[float], dict[str, list[str]]]:
    if eager:
        os.environ["VPIPE_LAB_EAGER"] = eager
    else:
        os.environ.pop("VPIPE_LAB_EAGER", None)
    entry = ZOO[name]
    with vpipe_lab.launch(entry.model, entry.data, stages=2, microbatches=4, optimizer=entry.optimizer, device="cpu",
                          timeout=300, start_timeout=600) as session:
        session.run(iterations)
        session.wait(timeout=900)
        frame = session.metrics.iterations
        memory = session.memory()  # the allocator's peak per stage (the workers measure it after a few iterations)
        peaks = [int(memory[memory.stage == s]["allocated_peak"].max()) for s in range(2)]
        return (float(frame["time_s"].iloc[3:].median()), peaks, list(frame["loss"]), session.eager)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mixtral", choices=sorted(ZOO))
    p.add_argument("--eager", default="MixtralSparseMoeBlock", help="module class(es) to run eagerly, comma-separated")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    ratios, memory = [], []
    for r in range(args.rounds):
        order = [None, args.eager] if r % 2 == 0 else [args.eager, None]
        got = {which: run(args.model, args.iterations, which) for which in order}
        traced, eager = got[None], got[args.eager]
        assert not traced[3] and eager[3], (traced[3], eager[3])
        same = traced[2] == eager[2]
        ratios.append(eager[0] / traced[0])
        memory.append(max(e / t for e, t in zip(eager[1], traced[1])))
        print(f"round {r}: traced {1e3 * traced[0]:.1f} ms, eager {1e3 * eager[0]:.1f} ms (x{ratios[-1]:.3f}); peaks "
              f"traced {[round(b / 2**20, 2) for b in traced[1]]} MiB, eager {[round(b / 2**20, 2) for b in eager[1]]} "
              f"MiB; losses {'equal' if same else 'DIFFER'}; eager units {sorted(eager[3])}", flush=True)
    print(f"{args.model} with {args.eager} eager: iteration x{statistics.median(ratios):.3f} (median of "
          f"{args.rounds} rounds, {min(ratios):.3f}-{max(ratios):.3f}), peak memory x{statistics.median(memory):.3f}")


if __name__ == "__main__":
    main()
