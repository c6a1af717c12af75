"""Models as ML engineers bring them, small enough for 2 CPU cores: HuggingFace GPT-2, torchvision ResNet-18, tied
nn.Sequentials, with their data. Factories are module-level functions so workers can import them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops

VOCAB, SEQ, BATCH = 97, 16, 8


def gpt2() -> nn.Module:
    """A tiny GPT-2 LM (tied embedding and head), random weights; dropout off so parity is exact."""
    allow_torchvision_without_ops()
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def gpt2_data(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Keyword inputs with an attention mask (some rows right-padded), next-token targets."""
    g = torch.Generator().manual_seed(500 + iteration)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1::2, -3:] = 0
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:]


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def resnet18() -> nn.Module:
    allow_torchvision_without_ops()
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def image_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """64x64 images, so BatchNorm in the last blocks still normalises over several values per channel."""
    g = torch.Generator().manual_seed(700 + iteration)
    return torch.randn(2 * BATCH, 3, 64, 64, generator=g), torch.randint(0, 10, (2 * BATCH,), generator=g)


def tied_sequential() -> nn.Sequential:
    """A language model as an nn.Sequential whose first and last layers share one weight."""
    embed = nn.Embedding(VOCAB, 24)
    head = nn.Linear(24, VOCAB, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), head)


def token_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + iteration)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def middle_tie() -> nn.Sequential:
    """Layers 2 and 6 share one weight, so the tie can move between stages."""
    layers: list[nn.Module] = [nn.Linear(6, 16), nn.Tanh()]
    shared = nn.Linear(16, 16)
    layers += [shared, nn.Tanh(), nn.Linear(16, 16), nn.Tanh()]
    other = nn.Linear(16, 16)
    other.weight = shared.weight
    layers += [other, nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def vector_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + iteration)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


class Encode(nn.Module):
    """An nn.Sequential child returning a dict with a None and a number in it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 16)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"hidden": torch.tanh(self.lin(x)), "mask": None, "scale": 0.5}


class Decode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, state: dict[str, Any]) -> torch.Tensor:
        assert state["mask"] is None
        return self.lin(state["hidden"]) * state["scale"]


def dict_sequential() -> nn.Sequential:
    return nn.Sequential(Encode(), Decode(), nn.Tanh(), nn.Linear(16, 3))


class TwoInputNet(nn.Module):
    """A plain nn.Module taking keyword arguments (features and a mask), with blocks in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 3)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.encode(features) * mask.unsqueeze(-1)
        for block in self.blocks:
            h = h + block(h)
        return {"prediction": self.head(h), "hidden": h}


def two_input_net() -> nn.Module:
    return TwoInputNet()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.gelu(self.lin(h))


class WithUnused(nn.Module):
    """Blocks in a ModuleList with tensors the forward never touches: a mask token in the embedding module (as
    DINOv2's), a head used only in another mode, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.embed.mask_token = nn.Parameter(torch.randn(1, 16))
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.blocks[1].gate = nn.Parameter(torch.ones(16))  # in a block that migrates
        self.head = nn.Linear(16, 3)
        self.pretrain_head = nn.Linear(16, 6)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def with_unused() -> nn.Module:
    return WithUnused()


def dict_mse(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output["prediction"], target)


def loader(batches: int = 3, shuffle: bool = True) -> torch.utils.data.DataLoader:
    """A DataLoader of ({features, mask}, target) batches with a seeded shuffle."""
    g = torch.Generator().manual_seed(5)
    features = torch.randn(batches * BATCH, 6, generator=g)
    mask = (torch.rand(batches * BATCH, generator=g) > 0.2).float()
    target = torch.randn(batches * BATCH, 3, generator=g)

    class Dicts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(target)

        def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            return {"features": features[i], "mask": mask[i]}, target[i]

    return torch.utils.data.DataLoader(Dicts(), batch_size=BATCH, shuffle=shuffle,
                                       generator=torch.Generator().manual_seed(11))


# --- models as their libraries build them, data as DataLoaders and collators give it ------------------------------------
def gpt2_defaults() -> nn.Module:
    """A GPT-2 built the way users build it: the config's defaults, use_cache=True included (dropout off for exact
    parity)."""
    allow_torchvision_without_ops()
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def gpt2_deeper() -> nn.Module:
    """zoo.gpt2 with one more block at the end (NAS: the other units keep their names and shapes)."""
    allow_torchvision_without_ops()
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=5, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def tied_llama() -> nn.Module:
    """A Llama whose LM head is its embedding (tie_word_embeddings), with a non-persistent rotary buffer."""
    allow_torchvision_without_ops()
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, tie_word_embeddings=True))


def varying_lengths(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What a collator that pads to the longest gives: 16 tokens, then 12, then 16, ..."""
    inputs, target = gpt2_data(iteration)
    length = SEQ if iteration % 2 == 0 else 12
    return {k: v[:, :length] for k, v in inputs.items()}, target[:, :length]


class Tokens(torch.utils.data.Dataset):
    """22 samples: with batch_size=8 and the default drop_last=False, every epoch ends with a batch of 6."""

    def __init__(self, samples: int = 22) -> None:
        g = torch.Generator().manual_seed(77)
        self.ids = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "attention_mask": torch.ones(SEQ, dtype=torch.long)}, self.ids[i, 1:]


def short_last_batch_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Tokens(), batch_size=BATCH)  # drop_last=False, as people write it


class LengthSwitch(nn.Module):
    """Python code that branches on a size: torch.export specialises the graph to one side, so the other side's
    batches need a capture of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if ids.shape[1] > 12:
            h = h * 0.5
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def length_switch() -> nn.Module:
    return LengthSwitch()


def switching_tokens(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, target = varying_lengths(iteration)
    return inputs["input_ids"], target


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
