"""Fused weight-gradient accumulation on and off, the two jobs alive at once and taking turns in short blocks.

    python benchmarks/fused_wgrad.py [--blocks 10] [--block 6]

Two vpipe_lab sessions of the same model, split, schedule and data, one with ``fused_wgrad=True`` (the default) and
one with ``fused_wgrad=False``; after warming up they run ``--block`` iterations each in turn (see
``benchmarks/interleaved.py`` for why blocks, not whole runs). Models: the bundled MLP (2048-wide layers,
micro-batches of 4 rows) and a HuggingFace GPT-2 of 512 hidden units as a user brings it (captured with torch.export,
so the fusion rewrites the graph's addmm/linear), both on 2 CPU stages with M = 8.
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from typing import Any

import torch
from interleaved import sessions_in_turn

import vpipe_lab

VOCAB, SEQ, BATCH = 512, 64, 16


def gpt2() -> torch.nn.Module:
    """GPT-2 with 512 hidden units and 4 layers (weights 512x1536, 512x2048: fused), random weights."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=512, n_layer=4, n_head=8,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def gpt2_data(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(iteration)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


JOBS: dict[str, dict[str, Any]] = {
    "mlp 3/7": {"model": "mlp", "plan": vpipe_lab.Plan((0, 3, 10), ("keep",) * 10, 8, "eager-1f1b")},
    "gpt2-512 (HuggingFace)": {"model": gpt2, "data": gpt2_data, "loss": lm_loss, "optimizer": adamw},
}


def compare(job: dict[str, Any], blocks: int, block: int) -> dict[bool, list[float]]:
    args = dict(job)
    model = args.pop("model")
    return sessions_in_turn({fused: partial(vpipe_lab.launch, model, stages=2, microbatches=8, schedule="eager-1f1b",
                                            device="cpu", timeout=300, start_timeout=300, fused_wgrad=fused, **args)
                             for fused in (True, False)}, blocks, block)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--block", type=int, default=6, help="iterations per block")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("| model | M | fused (ms/it) | plain autograd (ms/it) | speed-up, median (IQR) of adjacent blocks |")
    print("|---|---|---|---|---|")
    for name, job in JOBS.items():
        times = compare(job, args.blocks, args.block)
        ratios = sorted(p / f for f, p in zip(times[True], times[False]))
        q = statistics.quantiles(ratios, n=4)
        print(f"| {name} | 8 | {1e3 * statistics.median(times[True]):.1f} | "
              f"{1e3 * statistics.median(times[False]):.1f} | {q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f}) |", flush=True)


if __name__ == "__main__":
    main()
