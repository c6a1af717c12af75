"""The experts' load heatmap: shares per layer and expert, the layers in order, and bounded for any model size."""

from __future__ import annotations

from vpipe_lab.charts.expert_load import MAX_EXPERTS, MAX_LAYERS, experts_spec, load_matrix


def rows(iterations: int, layers: int, experts: int) -> list[dict]:  # type: ignore[type-arg]
    return [{"iteration": it, "stage": layer // 2, "layer": f"model.layers.{layer}.mlp",
             "tokens": [1 + (e == layer % experts) * 7 for e in range(experts)], "dropped": None}
            for it in range(iterations) for layer in range(layers)]


def test_each_cell_is_its_expert_s_share_of_the_layer_s_picks_over_the_iterations() -> None:
    got = experts_spec(rows(3, 2, 4))
    heat = got["data"][0]
    assert heat["type"] == "heatmap" and heat["x"] == ["0", "1", "2", "3"]
    assert heat["y"] == ["model.layers.0.mlp (stage 0)", "model.layers.1.mlp (stage 0)"]
    assert heat["z"][0] == [round(8 / 11, 4), round(1 / 11, 4), round(1 / 11, 4), round(1 / 11, 4)]
    assert heat["text"][1][1] == "24 tokens"  # over the 3 iterations
    assert load_matrix(rows(3, 2, 4))[2] == [[24, 3, 3, 3], [3, 24, 3, 3]]


def test_dropped_tokens_are_said_and_a_dense_model_gives_an_empty_figure() -> None:
    data = rows(1, 1, 2)
    data[0]["dropped"] = [0, 5]
    assert "5 dropped" in experts_spec(data)["data"][0]["text"][0][0]
    assert experts_spec([])["data"] == []


def test_deepseek_sized_layers_are_binned_into_a_bounded_grid() -> None:
    """58 MoE layers of 256 experts: at most MAX_LAYERS x MAX_EXPERTS cells, every token still counted once."""
    big = rows(1, 130, 256)
    heat = experts_spec(big)["data"][0]
    assert len(heat["z"]) <= MAX_LAYERS and all(len(r) <= MAX_EXPERTS for r in heat["z"])
    assert heat["x"][0] == "0-3" and heat["y"][0] == "model.layers.0.mlp .. model.layers.2.mlp (stage 0)"
    assert sum(int(t.split()[0]) for r in heat["text"] for t in r) == sum(sum(r["tokens"]) for r in big)
