"""Which parameters are tied across stages, and which plans a shared buffer forbids."""

from vpipe_lab.runtime.training.ties import conflict, holders


def test_holders_are_the_stages_that_use_a_parameter() -> None:
    plan = [[0, 1], [2, 3], [4]]
    params = [["emb"], ["a"], ["b"], ["emb2", "c"], ["emb", "emb2"]]
    assert holders(plan, params) == [("emb", (0, 2)), ("emb2", (1, 2))]
    assert holders([[0, 1, 2, 3, 4]], params) == []


def test_a_buffer_written_in_forward_cannot_be_shared_across_stages() -> None:
    buffers = [["bn.running_mean"], [], ["bn.running_mean"]]
    names = ["stem", "block", "stem-again"]
    message = conflict([[0, 1], [2]], buffers, {"bn.running_mean"}, names)
    assert message is not None and "'bn.running_mean' is shared by units ['stem', 'stem-again'] on stages [0, 1]" in message
    assert conflict([[0, 1, 2]], buffers, {"bn.running_mean"}, names) is None  # one stage: one tensor
    assert conflict([[0, 1], [2]], buffers, set(), names) is None  # read-only buffers may be copied
    assert conflict([[0, 1], [2]], buffers, None, names) is not None  # not known: assume written
