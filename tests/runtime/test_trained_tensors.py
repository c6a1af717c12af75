import torch

from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.trained_tensors import pack_state


def test_pack_state_uses_global_keys() -> None:
    stage = Stage(torch.device("cpu"), None, 0)
    stage.add_layer(7, torch.nn.BatchNorm1d(3))
    meta, buffers = pack_state(stage)
    keys = [m.key for m in meta]
    assert "7.weight" in keys and "7.running_mean" in keys and len(buffers) == len(meta)


def test_pack_state_names_every_alias_of_a_tie_and_leaves_out_non_persistent_buffers() -> None:
    from tests.runtime.model.test_capture import hf
    from vpipe_lab.runtime.model.capture import capture

    model = hf("llama")
    chain = capture(model, {"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    stage = Stage(torch.device("cpu"), None, 0)
    for i, unit in enumerate(chain.units):
        stage.add_layer(i, unit, chain.tensors[i])
    meta, _ = pack_state(stage, chain)
    by_key = {m.key: m for m in meta}
    assert "model.rotary_emb.inv_freq" not in by_key  # non-persistent: model.state_dict() leaves it out
    order = list(model.state_dict())
    tied = by_key["model.embed_tokens.weight"].aliases
    assert tied == [("model.embed_tokens.weight", order.index("model.embed_tokens.weight")),
                    ("lm_head.weight", order.index("lm_head.weight"))]
    assert sorted(a for m in meta for a, _ in m.aliases) == sorted(order)
