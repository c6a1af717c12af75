"""Real models stay live: batches as DataLoaders and padding collators give them, micro-batch counts changed while
training, models built with their library's defaults, and the trained weights back in the user's own model. Every
run is compared with plain single-process PyTorch taking the same batches in the same micro-batches, with SGD: over
several steps AdamW turns the rounding noise of GPT-2's attention key bias (whose true gradient is zero: softmax
ignores it) into lr-sized steps, which no two accumulation orders agree on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vpipe_lab
from tests.integration import zoo
from tests.runtime import reference
from vpipe_lab.core.errors import PlanError

pytestmark = pytest.mark.slow


def run(model, data, loss, *, iterations, stages=2, microbatches=4, optimizer=zoo.sgd, **kwargs):  # type: ignore[no-untyped-def]
    with vpipe_lab.launch(model, data, loss=loss, optimizer=optimizer, stages=stages, microbatches=microbatches,
                          device="cpu", timeout=90, start_timeout=180, **kwargs) as s:
        s.run(iterations)
        s.wait(timeout=300)
        return list(s.metrics.iterations["loss"]), s.state_dict(), s.names


def test_a_dataloader_with_a_short_last_batch_trains_as_plain_pytorch() -> None:
    """22 samples, batch 8, drop_last=False: the third batch has 6 samples, 4 micro-batches of 2, 2, 1, 1 whose
    losses count by their samples; the epoch then starts again. SGD, not AdamW: over five steps AdamW turns the
    rounding noise of GPT-2's attention key bias (whose true gradient is zero: softmax ignores it) into lr-sized
    steps, which no two accumulation orders agree on."""
    losses, state, _ = run(zoo.gpt2, zoo.short_last_batch_loader(), zoo.lm_loss, iterations=5)
    model, ref_losses = reference.train(zoo.gpt2, zoo.short_last_batch_loader(), zoo.lm_loss, zoo.sgd,
                                        iterations=5, microbatches=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    reference.assert_state_matches(state, model)


def test_sequence_lengths_that_change_every_batch_train_as_plain_pytorch() -> None:
    losses, state, _ = run(zoo.gpt2, zoo.varying_lengths, zoo.lm_loss, iterations=4)
    model, ref_losses = reference.train(zoo.gpt2, zoo.varying_lengths, zoo.lm_loss, zoo.sgd, iterations=4,
                                        microbatches=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    reference.assert_state_matches(state, model)


def test_a_graph_specialised_to_one_length_is_captured_again_for_the_other() -> None:
    """The model branches on the sequence length: captured at 16 tokens, a 12-token batch takes the other branch,
    which only a capture of its own computes (a reused graph would scale by 0.5 and the losses would differ)."""
    losses, state, names = run(zoo.length_switch, zoo.switching_tokens, zoo.token_loss, iterations=4)
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    model, ref_losses = reference.train(zoo.length_switch, zoo.switching_tokens, zoo.token_loss, zoo.sgd,
                                        iterations=4, microbatches=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    reference.assert_state_matches(state, model)


def test_the_microbatch_count_changes_live_on_a_captured_gpt2() -> None:
    """4 micro-batches, then 8 (of one sample each), then 2: each applied at an iteration boundary."""
    counts = {0: 4, 1: 4, 2: 8, 3: 8, 4: 2, 5: 2}
    with vpipe_lab.launch(zoo.gpt2, zoo.gpt2_data, loss=zoo.lm_loss, optimizer=zoo.sgd, stages=2,
                          microbatches=4, device="cpu", timeout=90) as s:
        for start in (0, 2, 4):
            if start:
                assert s.apply(s.plan.replace(microbatches=counts[start])) == start
            s.run(2)
            s.wait(timeout=300)
        frame = s.metrics.iterations
        losses, state = list(frame["loss"]), s.state_dict()
        assert list(frame["microbatches"]) == list(counts.values())
        found = s.replan(choose_microbatches=True, apply=True)  # chooses from curves the profiler measured
        sizes = {size for layer in found.profile.layers for size, _, _ in layer.times}
        assert len(sizes) >= 2 and found.plan.microbatches >= 1
        s.run(1)
        s.wait(timeout=300)
    model, ref_losses = reference.train(zoo.gpt2, zoo.gpt2_data, zoo.lm_loss, zoo.sgd, iterations=6,
                                        microbatches=counts.__getitem__)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    reference.assert_state_matches(state, model)


def test_a_gpt2_with_its_config_defaults_trains_as_plain_pytorch() -> None:
    losses, state, names = run(zoo.gpt2_defaults, zoo.gpt2_data, zoo.lm_loss, iterations=3)
    assert names[1] == "transformer.h.0"
    model, ref_losses = reference.train(zoo.gpt2_defaults, zoo.gpt2_data, zoo.lm_loss, zoo.sgd, iterations=3,
                                        microbatches=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    reference.assert_state_matches(state, model)


def test_the_weights_load_into_a_fresh_tied_llama_strictly_and_give_its_logits(tmp_path: Path) -> None:
    with vpipe_lab.launch(zoo.tied_llama, zoo.gpt2_data, loss=zoo.lm_loss, optimizer=zoo.sgd, stages=2,
                          microbatches=4, device="cpu", timeout=90) as s:
        s.run(2)
        s.wait(timeout=300)
        state = s.state_dict()
        folder = s.export(tmp_path / "llama")
    fresh = zoo.tied_llama()
    fresh.load_state_dict(state, strict=True)  # every alias of the tie, no non-persistent buffer
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]  # one tensor, as model.state_dict() has
    trained, _ = reference.train(zoo.tied_llama, zoo.gpt2_data, zoo.lm_loss, zoo.sgd, iterations=2, microbatches=4)
    inputs, _ = zoo.gpt2_data(10)
    fresh.eval()
    trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(**inputs).logits, trained(**inputs).logits, rtol=1e-5, atol=1e-5)
        import transformers

        loaded = transformers.LlamaForCausalLM.from_pretrained(folder)  # what export wrote, as its library reads it
        torch.testing.assert_close(loaded(**inputs).logits, fresh(**inputs).logits, rtol=0, atol=0)


def test_a_model_that_is_not_a_library_s_exports_as_a_state_dict_file(tmp_path: Path) -> None:
    with vpipe_lab.launch(zoo.tied_sequential, zoo.token_data, optimizer=zoo.adamw, stages=2, microbatches=4,
                          device="cpu", timeout=60) as s:
        s.run(1)
        s.wait(timeout=120)
        path = s.export(tmp_path / "tied.pt")
        state = s.state_dict()
    assert path == tmp_path / "tied.pt"
    model = zoo.tied_sequential()
    model.load_state_dict(torch.load(path), strict=True)
    assert torch.equal(model[0].weight, state["0.weight"]) and model[5].weight is model[0].weight


def test_set_model_on_a_captured_model_keeps_every_unchanged_unit(tmp_path: Path) -> None:
    with vpipe_lab.launch(zoo.gpt2, zoo.gpt2_data, loss=zoo.lm_loss, optimizer=zoo.adamw, stages=2,
                          microbatches=4, device="cpu", timeout=90) as s:
        s.run(2)
        s.wait(timeout=300)
        old = s.state_dict()
        at = s.set_model(zoo.gpt2_deeper)  # a fifth block at the end
        assert at == 2 and s.names[1:6] == [f"transformer.h.{i}" for i in range(5)]
        assert s.last_mapping == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: None, 6: 5}
        new = s.state_dict()
        assert all(torch.equal(new[k], v) for k, v in old.items())  # trained units kept their state
        assert any(k.startswith("transformer.h.4.") for k in new)
        with pytest.raises(PlanError, match=r"cannot replace the running one.*partition units.*fewer than the 2"):
            s.set_model(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)))  # nothing changes, training goes on
        s.run(2)
        s.wait(timeout=300)
        frame = s.metrics.iterations
        assert len(frame) == 4 and frame["loss"].notna().all() and s.names[5] == "transformer.h.4"
        s.export(tmp_path / "deeper")
    import transformers

    deeper = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "deeper")
    assert deeper.config.n_layer == 5


def test_set_model_carries_state_across_a_renumbering_with_a_mapping() -> None:
    """A block inserted before the others renumbers them: with mapping= each old block's state goes to its new
    index (its tensors' names change from transformer.h.i to transformer.h.i+1)."""
    with vpipe_lab.launch(zoo.gpt2, zoo.gpt2_data, loss=zoo.lm_loss, optimizer=zoo.adamw, stages=2,
                          microbatches=4, device="cpu", timeout=90) as s:
        s.run(1)
        s.wait(timeout=300)
        old = s.state_dict()
        s.set_model(zoo.gpt2_deeper, mapping={0: 0, 1: None, 2: 1, 3: 2, 4: 3, 5: 4, 6: 5})
        new = s.state_dict()
        for key, value in old.items():
            if key.startswith("transformer.h."):
                block, rest = key[len("transformer.h."):].split(".", 1)
                key = f"transformer.h.{int(block) + 1}.{rest}"
            assert torch.equal(new[key], value), key
        s.run(1)
        s.wait(timeout=300)
        assert s.metrics.iterations["loss"].notna().all()
