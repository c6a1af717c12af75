"""Capture: any nn.Module cut into named units whose chain computes exactly what the model computes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration import zoo
from vpipe_lab.runtime.model.batches import split
from vpipe_lab.runtime.model.capture import CaptureError, capture, state_names, to_meta
from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops


def run_chain(chain, inputs):
    carry = chain.start(inputs)
    for unit in chain.units:
        carry = unit(carry)
    return chain.finish(carry)


def hf(kind: str) -> torch.nn.Module:
    allow_torchvision_without_ops()
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=True, use_cache=False))


@pytest.mark.parametrize(("kind", "names"), [
    ("bert", ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2", "cls"]),
    ("llama", ["model.embed_tokens+model.rotary_emb", "model.layers.0", "model.layers.1", "model.layers.2",
               "model.norm+lm_head"]),
])
def test_transformers_models_are_cut_at_their_layers(kind: str, names: list[str]) -> None:
    torch.manual_seed(0)
    model = hf(kind).train()
    ids = torch.randint(0, 99, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -3:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    chain = capture(model, inputs)
    assert chain.names == names
    out = run_chain(chain, inputs)
    assert type(out).__name__ == type(model(**inputs)).__name__
    torch.testing.assert_close(out.logits, model(**inputs).logits, rtol=0, atol=0)


def test_gpt2_chain_gives_the_same_output_and_gradients_and_carries_the_mask() -> None:
    torch.manual_seed(0)
    model = zoo.gpt2().train()
    inputs, target = zoo.gpt2_data(0)
    chain = capture(model, inputs)
    assert len(chain.units[1].carry_keys) == 2  # the hidden state and the attention mask cross every block
    names = {c for t in chain.tensors for _, c in t.params}
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # the tie has one name
    zoo.lm_loss(run_chain(chain, inputs), target).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    zoo.lm_loss(model(**inputs), target).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_sequential_children_are_units_and_ties_share_a_name() -> None:
    model = zoo.tied_sequential()
    chain = capture(model, None)
    assert not chain.graph and chain.names[0] == "0:Embedding" and chain.names[-1] == "5:Linear"
    assert chain.tensors[5].params == [("weight", "0.weight")]
    assert chain.shared_params() == {"0.weight"}  # what the profile names so a stage holding both counts it once
    assert capture(zoo.middle_tie(), None).shared_params() == {"2.weight"}


def test_to_meta_frees_a_unit_but_not_its_tie_elsewhere() -> None:
    model = zoo.tied_sequential()
    chain = capture(model, None)
    to_meta(chain.units[5], chain.tensors[5])
    assert chain.units[5].weight.is_meta and not chain.units[0].weight.is_meta
    assert isinstance(chain.units[5].weight, torch.nn.Parameter)


def test_inputs_keep_their_structure_and_sizes_vary_where_the_model_lets_them() -> None:
    chain = capture(zoo.two_input_net(), {"features": torch.zeros(2, 6), "mask": torch.ones(2)})
    with pytest.raises(CaptureError, match="changed structure"):
        chain.start({"features": torch.zeros(2, 6)})
    chain.start({"features": torch.zeros(3, 6), "mask": torch.ones(3)})  # another batch size: the same graph
    with pytest.raises(CaptureError, match="input 0 has size 7 in dimension 1, where the graph is specialised to 6"):
        chain.start({"features": torch.zeros(3, 7), "mask": torch.ones(3)})
    with pytest.raises(CaptureError, match="ties to a size of 3"):
        chain.start({"features": torch.zeros(3, 6), "mask": torch.ones(4)})


def test_buffers_written_in_forward_are_known() -> None:
    model = zoo.resnet18()
    chain = capture(model, split(zoo.image_data(0)[0], 4, "inputs")[0])
    assert chain.mutated is not None
    assert {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"} <= chain.mutated
    assert not any(name.endswith("weight") for name in chain.mutated)


@pytest.fixture(scope="module")
def captured_gpt2() -> tuple[torch.nn.Module, Any]:
    """GPT-2 captured once on a (2, 16) micro-batch (one export, shared by the shapes below)."""
    torch.manual_seed(0)
    model = zoo.gpt2().train()
    chain = capture(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long),
                            "attention_mask": torch.ones(2, 16, dtype=torch.long)})
    return model.eval(), chain  # no dropout: the same numbers both ways


@pytest.mark.parametrize("shape", [(2, 16), (2, 9), (5, 16), (1, 16), (1, 1)])
def test_one_capture_takes_any_batch_size_and_sequence_length(shape: tuple[int, int],
                                                              captured_gpt2: tuple[torch.nn.Module, Any]) -> None:
    """Captured once on a (2, 16) micro-batch: other batch sizes and lengths run the same graph, exactly."""
    model, chain = captured_gpt2
    ids = torch.randint(0, 96, shape)
    inputs = {"input_ids": ids, "attention_mask": torch.ones(shape, dtype=torch.long)}
    assert chain.problem([("tensor", torch.int64, shape), ("tensor", torch.int64, shape)]) is None
    torch.testing.assert_close(run_chain(chain, inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_a_model_built_with_its_library_defaults_is_captured_without_its_generation_cache() -> None:
    allow_torchvision_without_ops()
    import transformers

    config = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    assert config.use_cache  # the default, as users build it
    model = transformers.GPT2LMHeadModel(config).train()
    inputs = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    chain = capture(model, inputs)
    assert chain.names[1:3] == ["transformer.h.0", "transformer.h.1"] and not model.config.use_cache
    out = run_chain(chain, {"input_ids": torch.randint(0, 96, (2, 8))})
    assert out.logits.shape == (2, 8, 96) and getattr(out, "past_key_values", None) is None


def test_state_names_are_what_the_model_s_state_dict_lists() -> None:
    model = hf("llama")
    from vpipe_lab.runtime.model.capture import canonical_names

    aliases, non_persistent = state_names(model, canonical_names(model))
    assert aliases["model.embed_tokens.weight"] == ["model.embed_tokens.weight", "lm_head.weight"]  # the tie, twice
    assert "model.rotary_emb.inv_freq" in non_persistent  # buffers the state dict leaves out
    assert sorted(n for names in aliases.values() for n in names) == sorted(model.state_dict())


def test_a_unit_laid_out_on_the_meta_device_is_captured_for_its_run_device_and_can_be_pointed_at_another() -> None:
    from vpipe_lab.runtime.build import on_meta

    meta, _ = on_meta(zoo.gpt2, 0)
    chain = capture(meta.train(), {"input_ids": torch.zeros(2, 8, dtype=torch.long, device="meta")},
                    device=torch.device("cpu"))

    def devices(unit: torch.nn.Module) -> set[str]:
        return {str(v) for n in unit.graph.graph.nodes for v in (*n.args, *n.kwargs.values())
                if isinstance(v, torch.device)}

    assert devices(chain.units[0]) == {"cpu"}  # positions and masks are made on the run device, not on meta
    assert all(t.is_meta for u in chain.units for t in u.parameters())  # still no memory: the layout's own tensors
    chain.units[0].retarget(torch.device("meta"))  # a stage on another device (a GPU) points the graph there
    assert devices(chain.units[0]) == {"meta"} and "type='cpu'" not in chain.units[0].graph.code
