from pathlib import Path

import pytest

from vpipe_lab.control.launch import _free_port, job_settings, launch


def test_a_plan_gives_the_job_its_stages_micro_batches_schedule_and_chunks_unless_they_are_given() -> None:
    from vpipe_lab.core.plan import Plan

    plan = Plan((0, 2, 4, 6, 8), ("keep",) * 8, 8, "interleaved-1f1b", 2)
    settings = job_settings(None, {}, plan)
    assert (settings.stages, settings.microbatches, settings.schedule, settings.virtual_stages) == (
        2, 8, "interleaved-1f1b", 2)
    assert job_settings(None, {"microbatches": 4}, plan).microbatches == 4  # then the plan is refused for it


def test_free_port() -> None:
    assert 0 < _free_port("127.0.0.1") < 65536


def test_virtual_stages_are_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs a chunked schedule, not '1f1b' \(the chunked ones: "):
        launch("mlp", stages=2, microbatches=4, virtual_stages=2, device="cpu")
    with pytest.raises(ValueError, match="at least 2 stages"):
        launch("mlp", stages=1, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2, device="cpu")
    with pytest.raises(ValueError, match="microbatches=3 must be a multiple of 2"):
        launch("mlp", stages=2, microbatches=3, schedule="interleaved-1f1b", virtual_stages=2, device="cpu")
    with pytest.raises(ValueError, match="virtual_stages must be a whole number >= 1"):
        launch("mlp", stages=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=0, device="cpu")
    with pytest.raises(ValueError, match="zbv runs 2 chunks per stage, not virtual_stages=3"):
        launch("mlp", stages=2, microbatches=4, schedule="zbv", virtual_stages=3, device="cpu")
    with pytest.raises(ValueError, match="at least 2 stages"):  # two chunks on one stage would be no pipeline
        launch("mlp", stages=1, microbatches=4, schedule="zbv", device="cpu")


def test_pipedream_refuses_what_needs_one_step_of_the_whole_model() -> None:
    """Clipping by the global norm, one fp16 loss scale and replica averaging each need a step every stage takes at
    once; PipeDream's stages update on their own after every micro-batch."""
    with pytest.raises(ValueError, match=r"clip_grad_norm=1\.0 clips by the whole model's gradient norm"):
        launch("mlp", stages=2, microbatches=4, schedule="pipedream", clip_grad_norm=1.0, device="cpu")
    with pytest.raises(ValueError, match=r"precision='fp16'.*use precision='bf16'"):
        launch("mlp", stages=2, microbatches=4, schedule="pipedream", precision="fp16", device="cpu")
    with pytest.raises(ValueError, match="replicas=2 average gradients once per iteration"):
        launch("mlp", stages=2, microbatches=4, schedule="pipedream", replicas=2, device="cpu")


def test_a_timeout_that_is_not_a_number_of_seconds_is_refused_before_anything_starts() -> None:
    for name, value in (("timeout", None), ("timeout", 0), ("start_timeout", float("inf")), ("timeout", "60")):
        with pytest.raises(ValueError, match=f"{name}={value!r}: give the seconds to wait at most"):
            launch("mlp", stages=2, microbatches=4, device="cpu", **{name: value})


def test_restart_settings_are_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="max_restarts must be a whole number >= 0"):
        launch("mlp", stages=2, microbatches=4, max_restarts=-1, device="cpu")
    with pytest.raises(ValueError, match="max_restarts=1 needs engine='lab'"):
        launch("mlp", stages=2, microbatches=4, max_restarts=1, engine="torch", device="cpu")
    with pytest.raises(ValueError, match="snapshot_every=5: snapshots are for restarts"):
        launch("mlp", stages=2, microbatches=4, snapshot_every=5, device="cpu")


def test_launch_and_attach_build_the_session_without_reaching_into_it() -> None:
    """How a Session opens (its workers started, restarts wired, a resumed plan version; or a torchrun job's ranks
    taken over) is the Session's own (``Opening``/``Joining`` for its Lifecycle): launch.py sets no private member."""
    import ast

    import vpipe_lab.control.launch as launch_module

    tree = ast.parse(Path(launch_module.__file__).read_text())
    reached = sorted({f"{node.value.id}.{node.attr}" for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and isinstance(node.value, ast.Name) and node.value.id == "session" and node.attr.startswith("_")})
    assert reached == []


def test_attaching_before_every_rank_is_ready_lets_go_and_says_so() -> None:
    import threading
    from types import SimpleNamespace

    from vpipe_lab.control.lifecycle import Joining, Lifecycle, Ranks
    from vpipe_lab.control.state import JobState

    class Host:
        detached = False

        def detach(self) -> None:
            self.detached = True

    host, state = Host(), JobState()
    wiring = Lifecycle(host, Ranks(2, 1), None, None, None, state, threading.Condition(), None, None,  # type: ignore[arg-type]
                       None, None, None, None, None)  # type: ignore[arg-type]
    welcome = SimpleNamespace(ready=[{}], current=None)  # rank 0 is ready, rank 1 not yet
    with pytest.raises(TimeoutError, match="only 1 of 2 ranks are ready yet; attach again shortly"):
        wiring.join(Joining(None, welcome, 1.0))  # type: ignore[arg-type]
    assert host.detached and state.ready == {}
