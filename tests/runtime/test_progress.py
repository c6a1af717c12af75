from vpipe_lab.runtime.progress import Control


def test_a_rank_trains_while_it_is_asked_to() -> None:
    assert not Control().active  # target 0: waiting for a run command
    assert Control(target=None).active and Control(iteration=2, target=3).active
    assert not Control(iteration=3, target=3).active
    assert not Control(target=None, paused=True).active and not Control(target=None, stopping=True).active


def test_pause_resume_and_stop() -> None:
    import pytest

    c = Control(target=None)
    c.take("pause")
    assert c.paused and not c.active
    c.take("resume")
    assert c.active
    c.take("stop")
    assert c.stopping and not c.active
    with pytest.raises(ValueError, match="not a run-state command"):
        c.take("run")
