"""PipeDream's kind: asynchronous, its weight copies, its refusals said once, never exported nor chosen by "auto"."""

from vpipe_lab.core import schedules


def test_pipedream() -> None:
    kind = schedules.get("pipedream")
    assert kind.asynchronous and kind.auto_virtuals(2, 8, 4) == () and kind.torch is None
    assert "step once per iteration" in kind.export_refusal
    assert kind.stashed_versions(3, 0, 8) == 2 and kind.stashed_versions(3, 2, 8) == 0
    assert kind.weight_copies(3, 0, 8) > 0
    assert "replicas=2" in (kind.training_refusal(None, "fp32", 2) or "")
    assert kind.training_refusal(None, "bf16", 1) is None
    assert kind.build(2, 4).name == "pipedream"
