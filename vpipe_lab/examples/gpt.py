"""A small character-level GPT trained on Python's own standard-library source, which every install ships.

Partition units are the embedding, one attention and one MLP block per layer (each with its residual add inside, so
cuts fall at residual adds as in the paper), and the head.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS, BATCH = 96, 64, 96, 4, 3, 32
_MODULES = ("textwrap", "argparse", "string", "heapq", "bisect", "fractions", "statistics")


@functools.lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """Printable ASCII of a few standard-library modules' source, as byte codes 0..95."""
    import importlib

    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in _MODULES)
    codes = [min(max(ord(c) - 32, 0), VOCAB - 1) if c != "\n" else 0 for c in text]
    return torch.tensor(codes, dtype=torch.long)


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(CONTEXT, WIDTH)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def model() -> nn.Sequential:
    blocks: list[nn.Module] = [Embedding()]
    for _ in range(LAYERS):
        blocks += [Attention(), MLP()]
    blocks += [nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))]
    return nn.Sequential(*blocks)


def data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``BATCH`` random windows of the corpus, the same for the same iteration."""
    text = corpus()
    g = torch.Generator().manual_seed(77_000 + iteration)
    starts = torch.randint(0, len(text) - CONTEXT - 1, (BATCH,), generator=g)
    windows = torch.stack([text[s:s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)  # type: ignore[arg-type]
