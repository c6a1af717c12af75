from vpipe_lab.core.cost.shared_bytes import SharedBytes
from vpipe_lab.core.profile import SharedTensor

# A T5-like tie: the encoder's embedding (unit 0), the decoder's lookup of it (unit 2) and the LM head (unit 5); 100
# bytes of weight, 100 of gradient and 200 of Adam state: 400 a stage holds once however many of the three it holds.
TIE = SharedTensor("shared.weight", (5, 0, 2), param_bytes=100, optimizer_bytes=200)


def test_a_range_holding_several_users_counts_the_tensor_once() -> None:
    shared = SharedBytes([TIE])
    assert TIE.units == (0, 2, 5) and TIE.static_bytes == 400
    assert shared.extra(0, 1) == (0, 0)  # one user: nothing counted twice
    assert shared.extra(1, 5) == (0, 0)
    assert shared.extra(0, 3) == (400, 100)  # units 0 and 2: one copy too many
    assert shared.extra(0, 6) == (800, 200)  # all three: two too many
    assert shared.extra(2, 6) == (400, 100)
    assert SharedBytes([]).extra(0, 6) == (0, 0)


def test_chunks_of_one_stage_that_share_a_tensor_hold_it_once() -> None:
    """ZBV's stage 0 holds the first chunk (the embedding) and the last (the head): beyond what each chunk takes off
    itself, the stage's sum counts the tensor once more for each further chunk that uses it."""
    shared = SharedBytes([TIE])
    assert shared.across([range(0, 1), range(5, 6)]) == 400
    assert shared.across([range(0, 3), range(5, 6)]) == 400  # 0 and 2 already counted once by their chunk
    assert shared.across([range(0, 1), range(1, 2)]) == 0  # one user on the stage
    assert shared.across([range(0, 6)]) == 0  # one chunk: its own extra covers it
