"""The model zoo's start-up and parity, one model at a time: how long ``launch`` takes to the session being ready and
to the end of the first iteration, how the model is cut, and whether two iterations on 2 stages equal one process.

    python benchmarks/zoo.py [NAME ...]

Each model runs alone (nothing else on the machine), 2 stages, 2 micro-batches, from a warm zygote (a second launch
in the same process: ``launch`` forks workers from a parent that imported torch and transformers once). Prints the
markdown table docs/models.md and RESULTS.md hold.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vpipe_lab
from tests.models.zoo import ZOO
from tests.runtime import reference
from vpipe_lab.runtime.engine.executor import default_loss


def measure(name: str) -> str:
    entry = ZOO[name]
    start = time.perf_counter()
    with vpipe_lab.launch(entry.model, entry.data, stages=2, microbatches=2, optimizer=entry.optimizer, device="cpu",
                          timeout=300, start_timeout=600) as session:
        ready = time.perf_counter() - start
        session.run(1)
        session.wait(timeout=600)
        first = time.perf_counter() - start
        session.run(1)
        session.wait(timeout=600)
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
        names = list(session.names)
    torch.set_num_threads(1)
    model, expected = reference.train(entry.model, entry.data, default_loss, entry.optimizer, iterations=2,
                                      microbatches=2)
    worst = max((state[k].float() - v.float()).abs().max().item() for k, v in model.state_dict().items())
    same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, expected)) and worst <= 1e-5
    blocks = [n for n in names[1:-1]]
    cut = f"`{blocks[0]}` ... `{blocks[-1]}`" if blocks else "-"
    verdict = "equal" if same else f"differs (max {worst:.1e})"
    return (f"| {name} | {entry.family} | {len(names)} | {cut} | {ready:.1f} | {first:.1f} | {verdict} "
            f"({worst:.0e}) |")


def main() -> None:
    os.environ.setdefault("VPIPE_LAB_PRELOAD", "transformers")
    names = sys.argv[1:] or list(ZOO)
    with vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu") as warm:  # the zygote, warm
        warm.run(1)
        warm.wait(timeout=120)
    print("| model | family | units | default cut (first ... last block) | ready (s) | first iteration done (s) | "
          "2 iterations vs one process (largest difference) |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        try:
            print(measure(name), flush=True)
        except Exception as exc:  # a refusal is a row too
            print(f"| {name} | {ZOO[name].family} | - | - | - | - | refused: {str(exc).splitlines()[0][:160]} |",
                  flush=True)


if __name__ == "__main__":
    main()
