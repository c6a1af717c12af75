"""Per-sample training time against micro-batch size, one CPU thread, plain PyTorch (forward, loss, backward): where
a larger micro-batch runs closer to the machine's peak, which is what vPipe's memory savings buy on a GPU.

    python benchmarks/microbatch_curve.py
"""

from __future__ import annotations

import statistics
import time

import torch

from vpipe_lab.examples import get


def main() -> None:
    torch.set_num_threads(1)
    for name in ("mlp", "gpt-tiny"):
        ex = get(name)
        model = ex.model()
        x, y = ex.data(0)
        out = []
        for mb in (1, 2, 4, 8, 16, 32):
            xs, ys = x[:mb], y[:mb]
            times = []
            for _ in range(7):
                start = time.perf_counter()
                ex.loss(model(xs), ys).backward()
                times.append(time.perf_counter() - start)
            model.zero_grad()
            out.append((mb, 1e3 * statistics.median(times[2:]) / mb))  # the first two warm the allocator
        print(name, " ".join(f"mb{m}: {t:.2f} ms/sample" for m, t in out), flush=True)


if __name__ == "__main__":
    main()
