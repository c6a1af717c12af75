"""The model zoo: the families users bring, each in a tiny configuration with random weights (nothing downloaded),
with its data, loss and optimizer. Factories are module-level so the workers import them. Dropout is off in every
model: the pipeline seeds each unit's dropout, plain PyTorch one stream, so their masks differ by design."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops

VOCAB, SEQ, BATCH, IMAGE, CLASSES = 96, 12, 8, 32, 10


def _hf() -> Any:
    allow_torchvision_without_ops()
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


# --- data ------------------------------------------------------------------------------------------------------------
def lm_data(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Token ids with an attention mask (some rows right-padded) and next-token targets."""
    g = torch.Generator().manual_seed(1_000 + iteration)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1::2, -3:] = 0
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:]


def seq2seq_data(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(2_000 + iteration)
    src = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(1, VOCAB, (BATCH, SEQ // 2 + 1), generator=g)
    return {"input_ids": src, "decoder_input_ids": tgt[:, :-1]}, tgt[:, 1:]


def image_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3_000 + iteration)
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def large_image_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """64 x 64: GoogLeNet pools 32 x 32 images down to nothing."""
    g = torch.Generator().manual_seed(4_000 + iteration)
    return torch.randn(BATCH, 3, 2 * IMAGE, 2 * IMAGE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def hf_image_data(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    x, y = image_data(iteration)
    return {"pixel_values": x}, y


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


# --- transformers -------------------------------------------------------------------------------------------------
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=64)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def gpt2() -> nn.Module:
    t = _hf()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0))


def llama() -> nn.Module:
    t = _hf()
    return t.LlamaForCausalLM(t.LlamaConfig(**TINY, num_key_value_heads=2))


def qwen2() -> nn.Module:
    t = _hf()
    return t.Qwen2ForCausalLM(t.Qwen2Config(**TINY, num_key_value_heads=2))


def mistral() -> nn.Module:
    t = _hf()
    return t.MistralForCausalLM(t.MistralConfig(**TINY, num_key_value_heads=2))


def gpt_neox() -> nn.Module:
    t = _hf()
    return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**TINY, hidden_dropout=0.0, attention_dropout=0.0))


def opt() -> nn.Module:
    t = _hf()
    return t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=4,
                                        num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
                                        dropout=0.0, attention_dropout=0.0, pad_token_id=0))


def bert() -> nn.Module:
    t = _hf()
    return t.BertForMaskedLM(t.BertConfig(**TINY, **NO_DROPOUT))


def roberta() -> nn.Module:
    t = _hf()
    return t.RobertaForMaskedLM(t.RobertaConfig(**{**TINY, "max_position_embeddings": 70}, **NO_DROPOUT,
                                                pad_token_id=0))


def albert() -> nn.Module:
    t = _hf()
    return t.AlbertForMaskedLM(t.AlbertConfig(**TINY, embedding_size=16, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0))


def t5() -> nn.Module:
    t = _hf()
    return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2,
                                                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0))


def bart() -> nn.Module:
    t = _hf()
    return t.BartForConditionalGeneration(t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2,
                                                       decoder_layers=2, encoder_attention_heads=4,
                                                       decoder_attention_heads=4, encoder_ffn_dim=64,
                                                       decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                                                       attention_dropout=0.0, activation_dropout=0.0))


def vit() -> nn.Module:
    t = _hf()
    return t.ViTForImageClassification(t.ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=32,
                                                   intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                                   num_labels=CLASSES, **NO_DROPOUT))


def swin() -> nn.Module:
    t = _hf()
    return t.SwinForImageClassification(t.SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[2, 2],
                                                     num_heads=[2, 4], window_size=4, num_labels=CLASSES,
                                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                     drop_path_rate=0.0))


def dinov2() -> nn.Module:
    """Its ``embeddings.mask_token`` is used only when a mask is given: the forward here never touches it."""
    t = _hf()
    return t.Dinov2ForImageClassification(t.Dinov2Config(image_size=IMAGE, patch_size=8, hidden_size=32,
                                                         intermediate_size=64, num_hidden_layers=4,
                                                         num_attention_heads=4, num_labels=CLASSES, drop_path_rate=0.0,
                                                         **NO_DROPOUT))


def convnext_hf() -> nn.Module:
    t = _hf()
    return t.ConvNextForImageClassification(t.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16, 32, 64],
                                                             depths=[1, 1, 2, 1], num_labels=CLASSES,
                                                             drop_path_rate=0.0))


# --- mixtures of experts (transformers): 4 experts, 2 per token, every layer sparse unless the family keeps dense ones
MOE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=64)


def mixtral() -> nn.Module:
    t = _hf()
    return t.MixtralForCausalLM(t.MixtralConfig(**MOE, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2))


def dbrx() -> nn.Module:
    """DBRX: its experts skip those that received no tokens (a branch on a tensor's values torch.export cannot
    trace), so they run eagerly inside their layer's unit (runtime/model/trace/eager.py)."""
    t = _hf()
    return t.DbrxForCausalLM(t.DbrxConfig(
        d_model=32, n_heads=4, n_layers=4, max_seq_len=64, vocab_size=VOCAB,
        attn_config={"kv_n_heads": 2, "rope_theta": 10_000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}))


def gemma3n() -> nn.Module:
    """Gemma-3n's text model: a decoder layer makes a tensor the trace cannot follow (torch.export lifts it as a fake
    constant), so each layer runs eagerly as its own unit (runtime/model/trace/eager.py)."""
    t = _hf()
    return t.Gemma3nForCausalLM(t.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=0,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
        activation_sparsity_pattern=[0.0] * 4))


def qwen3_moe() -> nn.Module:
    t = _hf()
    return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**MOE, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                  num_experts_per_tok=2, head_dim=8))


def olmoe() -> nn.Module:
    t = _hf()
    return t.OlmoeForCausalLM(t.OlmoeConfig(**MOE, intermediate_size=32, num_experts=4, num_experts_per_tok=2))


def deepseek_v3() -> nn.Module:
    """Multi-head latent attention (no grouped KV heads), one shared expert beside the routed ones, grouped top-k
    routing, and a dense first layer (``first_k_dense_replace``), as DeepSeek-V3 is built."""
    t = _hf()
    return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        **{**MOE, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8))


def qwen2_moe() -> nn.Module:
    t = _hf()
    return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**MOE, intermediate_size=64, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32, num_experts=4,
                                                  num_experts_per_tok=2))


def gpt_oss() -> nn.Module:
    t = _hf()
    return t.GptOssForCausalLM(t.GptOssConfig(**MOE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                              head_dim=8, sliding_window=8))


def llama4() -> nn.Module:
    """Llama 4's text model: one routed expert per token beside a shared one, every layer sparse."""
    t = _hf()
    return t.Llama4ForCausalLM(t.Llama4TextConfig(**MOE, intermediate_size=32, intermediate_size_mlp=64,
                                                  num_local_experts=4, num_experts_per_tok=1, head_dim=8,
                                                  interleave_moe_layer_step=1))


# --- torchvision ----------------------------------------------------------------------------------------------------
def _tv() -> Any:
    allow_torchvision_without_ops()
    import torchvision

    return torchvision.models


def resnet18() -> nn.Module:
    return _tv().resnet18(num_classes=CLASSES)


def mobilenet_v3_small() -> nn.Module:
    return _tv().mobilenet_v3_small(num_classes=CLASSES, dropout=0.0)


def efficientnet_b0() -> nn.Module:
    return _tv().efficientnet_b0(num_classes=CLASSES, dropout=0.0, stochastic_depth_prob=0.0)


def densenet121() -> nn.Module:
    return _tv().densenet121(num_classes=CLASSES)


def shufflenet() -> nn.Module:
    return _tv().shufflenet_v2_x0_5(num_classes=CLASSES)


def regnet() -> nn.Module:
    return _tv().regnet_y_400mf(num_classes=CLASSES)


def squeezenet() -> nn.Module:
    return _tv().squeezenet1_1(num_classes=CLASSES, dropout=0.0)


def googlenet() -> nn.Module:
    return _tv().googlenet(num_classes=CLASSES, aux_logits=False, init_weights=False, dropout=0.0)


def vit_tv() -> nn.Module:
    models = _tv()
    return models.VisionTransformer(image_size=IMAGE, patch_size=8, num_layers=4, num_heads=4, hidden_dim=32,
                                    mlp_dim=64, num_classes=CLASSES)


def convnext_tv() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    _tv()
    return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 2)],
                    stochastic_depth_prob=0.0, num_classes=CLASSES)


def swin_tv() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    _tv()
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
                           stochastic_depth_prob=0.0, num_classes=CLASSES)


@dataclass(frozen=True)
class Entry:
    """A zoo model: its family, factory, data and optimizer; ``refused``: the words its refusal must contain."""

    family: str
    model: Callable[[], nn.Module]
    data: Callable[[int], Any]
    optimizer: Callable[[Any], torch.optim.Optimizer] = adamw
    refused: str | None = None


ZOO: dict[str, Entry] = {
    "gpt2": Entry("decoder LM", gpt2, lm_data),
    "llama": Entry("decoder LM", llama, lm_data),
    "qwen2": Entry("decoder LM", qwen2, lm_data),
    "mistral": Entry("decoder LM", mistral, lm_data),
    "gpt-neox": Entry("decoder LM", gpt_neox, lm_data),
    "opt": Entry("decoder LM", opt, lm_data),
    "bert": Entry("encoder", bert, lm_data),
    "roberta": Entry("encoder", roberta, lm_data),
    "albert": Entry("encoder", albert, lm_data),
    "t5": Entry("encoder-decoder", t5, seq2seq_data),
    "bart": Entry("encoder-decoder", bart, seq2seq_data),
    "vit": Entry("vision transformer", vit, hf_image_data),
    "swin": Entry("vision transformer", swin, hf_image_data),
    "dinov2": Entry("vision transformer", dinov2, hf_image_data),
    "convnext (HF)": Entry("convnet", convnext_hf, hf_image_data, sgd),
    "resnet18": Entry("convnet", resnet18, image_data, sgd),
    "mobilenet_v3_small": Entry("convnet", mobilenet_v3_small, image_data, sgd),
    "efficientnet_b0": Entry("convnet", efficientnet_b0, image_data, sgd),
    "densenet121": Entry("convnet", densenet121, image_data, sgd),
    "shufflenet_v2": Entry("convnet", shufflenet, image_data, sgd),
    "regnet_y_400mf": Entry("convnet", regnet, image_data, sgd),
    "squeezenet1_1": Entry("convnet", squeezenet, image_data, sgd),
    "googlenet": Entry("convnet", googlenet, large_image_data, sgd),
    "mixtral": Entry("mixture of experts", mixtral, lm_data),
    "qwen3-moe": Entry("mixture of experts", qwen3_moe, lm_data),
    "olmoe": Entry("mixture of experts", olmoe, lm_data),
    "deepseek-v3": Entry("mixture of experts", deepseek_v3, lm_data),
    "qwen2-moe": Entry("mixture of experts", qwen2_moe, lm_data),
    "gpt-oss": Entry("mixture of experts", gpt_oss, lm_data),
    "llama4": Entry("mixture of experts", llama4, lm_data),
    "dbrx": Entry("traced in part", dbrx, lm_data),
    "gemma-3n": Entry("traced in part", gemma3n, lm_data),
    "vit (torchvision)": Entry("vision transformer", vit_tv, image_data),
    "convnext (torchvision)": Entry("convnet", convnext_tv, image_data, sgd),
    "swin (torchvision)": Entry("vision transformer", swin_tv, image_data),
}


def check(name: str) -> list[str]:
    """Train zoo model ``name`` 2 iterations on 2 stages (2 micro-batches, the default cut) and in one plain process
    with the same micro-batches, and assert they agree: every loss, parameter and buffer. The plain process runs on
    one thread, as the workers do: these tiny batch-normalised convnets are so ill-conditioned that one thread or two
    alone moves a weight of RegNet by 46 after two steps (tests/models/README note in docs/models.md). Returns the
    units' names."""
    import vpipe_lab

    entry = ZOO[name]
    with vpipe_lab.launch(entry.model, entry.data, stages=2, microbatches=2, optimizer=entry.optimizer, device="cpu",
                          timeout=300, start_timeout=300) as session:
        session.run(2)
        session.wait(timeout=300)
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
        names = list(session.names)
    assert_equal_to_one_process(name, losses, state, iterations=2, microbatches=2)
    return names


def assert_equal_to_one_process(name: str, losses: list[float], state: dict[str, torch.Tensor], *, iterations: int,
                                microbatches: int) -> None:
    """A pipelined run of zoo model ``name`` (its ``losses`` and ``session.state_dict()``) against one plain process
    taking the same micro-batches, on one thread as the workers run (see ``check``): every loss, parameter, buffer."""
    from tests.runtime import reference
    from vpipe_lab.runtime.engine.executor import default_loss

    entry = ZOO[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, expected = reference.train(entry.model, entry.data, default_loss, entry.optimizer,
                                          iterations=iterations, microbatches=microbatches)
    finally:
        torch.set_num_threads(threads)
    assert losses == pytest_approx(expected), name
    reference.assert_state_matches(state, model)


def pytest_approx(values: list[float]) -> Any:
    import pytest

    return pytest.approx(values, rel=1e-5)
