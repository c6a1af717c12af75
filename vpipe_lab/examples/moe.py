"""A small mixture-of-experts language model (transformers' Qwen3-MoE) on the same characters as ``gpt-tiny``.

Six decoder layers: the first dense (as DeepSeek-V3 keeps its first layers dense), the other five each with 8 experts
of which every token takes 2, and the router's load-balancing loss added to the language-model loss (the model's own
``aux_loss``, weighted by ``router_aux_loss_coef``). The expert layers hold several times the parameters of the
dense one for about the same compute per token, so memory, not time, decides where a pipeline cuts it. Partition
units: the embedding, each decoder layer, and the final norm with the head. Needs transformers (``pip install
vpipe-lab[all]``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vpipe_lab.examples.gpt import CONTEXT, VOCAB
from vpipe_lab.examples.gpt import data as gpt_data

LAYERS, WIDTH, EXPERTS, TOP_K = 6, 64, 8, 2


def model() -> nn.Module:
    # transformers imports torchvision where it is installed: ``import vpipe_lab`` armed the guard that keeps it
    # importable next to a CPU-only torch (import_guard.py), and a worker runs it before it builds any model
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, moe_intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=WIDTH // 4,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, mlp_only_layers=[0], max_position_embeddings=CONTEXT,
        output_router_logits=True, router_aux_loss_coef=0.01, use_cache=False)
    return transformers.Qwen3MoeForCausalLM(config)


def data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``gpt-tiny``'s windows of standard-library source: token ids (the model's ``input_ids``) and the next ones."""
    return gpt_data(iteration)


def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy plus the router's load-balancing loss, as the model's own loss adds them."""
    lm = nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))
    aux = getattr(output, "aux_loss", None)
    return lm if aux is None else lm + 0.01 * aux


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)  # type: ignore[arg-type]
