from vpipe_lab.runtime.progress import Control


def test_a_rank_trains_while_it_is_asked_to() -> None:
    assert not Control().active  # target 0: waiting for a run command
    assert Control(target=None).active and Control(iteration=2, target=3).active
    assert not Control(iteration=3, target=3).active
    assert not Control(target=None, paused=True).active and not Control(target=None, stopping=True).active
