"""A transformers GPT-2 as a torch.distributed.pipelining user splits one by hand, for both sides of a comparison:
the embeddings, each ``GPT2Block`` and the final norm with the LM head as ``nn.Sequential`` units (their output
equals ``GPT2LMHeadModel``'s logits exactly; dropout off). Random weights from a small config: nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH, SEQ, VOCAB = 32, 64, 256


class Embed(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)  # causal attention without a mask (transformers 5 returns the hidden states)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def model() -> nn.Sequential:
    import transformers

    from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops

    allow_torchvision_without_ops()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=6, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0))
    t = hf.transformer
    return nn.Sequential(Embed(t.wte, t.wpe), *(Block(b) for b in t.h), Head(t.ln_f, hf.lm_head))


def data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + iteration)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)  # type: ignore[arg-type]
