"""What counting the experts' load costs: each micro-batch's forward and backward through moe-tiny's captured units
with the counting on and off, alternating call by call in one process (one thread, as a worker runs), and the ratio of
their medians; then what one counting call costs alone.

    python benchmarks/expert_load.py [--repeats 200] [--model moe-tiny]

Launching two sessions and comparing their iteration times cannot see a difference this small on a shared 2-core
machine (their medians move by 10-25% from one launch to the next); alternating within one process can. The counting
is the call the capture adds after each MoE layer's router (``runtime/model/experts.py``); reading the counts back
is one copy per iteration and not timed here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from vpipe_lab import examples
from vpipe_lab.runtime.model import experts
from vpipe_lab.runtime.model.batches import split
from vpipe_lab.runtime.model.capture import capture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moe-tiny")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ex = examples.get(args.model)
    torch.manual_seed(0)
    model = ex.model().train()
    inputs, targets = ex.data(0)
    x, y = split(inputs, 4, "inputs")[0], split(targets, 4, "targets")[0]
    chain = capture(model, x)
    layers = len(chain.experts)

    def step(counted: bool) -> float:
        start = time.perf_counter()
        with experts.counting() if counted else nullcontext():
            carry = chain.start(x)
            for unit in chain.units:
                carry = unit(carry)
            loss = ex.loss(chain.finish(carry), y)
        loss.backward()
        return time.perf_counter() - start

    on, off = [], []
    for i in range(2 * args.repeats):
        (on if i % 2 else off).append(step(i % 2 == 1))
    experts.take()
    a, b = statistics.median(on), statistics.median(off)
    picks = torch.randint(0, 8, (x.numel(), 2))  # a micro-batch's tokens, top-2 of 8 experts
    with experts.counting():
        start = time.perf_counter()
        for _ in range(1000):
            experts.tally(picks, "bench", 8, None, True)
        call = (time.perf_counter() - start) / 1000
    experts.take()
    print(f"{args.model}: {layers} MoE layers, a micro-batch of {x.shape[0]} x {x.shape[1]} tokens, forward and "
          f"backward through every unit: counted {1e3 * a:.2f} ms, not counted {1e3 * b:.2f} ms (medians of "
          f"{args.repeats} each, alternating): counting costs {100 * (a / b - 1):+.2f}%")
    print(f"one counting call: {1e6 * call:.1f} us; {layers} a micro-batch = {100 * layers * call / b:.2f}% of its "
          "forward and backward")


if __name__ == "__main__":
    main()
