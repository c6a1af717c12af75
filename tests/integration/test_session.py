"""The Session API against real workers: background training, pause/resume, events, profile, state."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

import vpipe_lab
from vpipe_lab import ModelProfile, plan
from vpipe_lab.control.errors import SessionClosed
from vpipe_lab.core.profile import Cluster

pytestmark = pytest.mark.slow


def _cores(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def test_background_training_pause_resume_events_profile() -> None:
    events: list[dict] = []
    lock = threading.Lock()
    with vpipe_lab.launch("gpt-tiny", stages=2, microbatches=4, device="cpu", timeout=60) as s:
        s.on_event(lambda e: (lock.acquire(), events.append(e), lock.release()))
        assert s.iteration == 0 and s.num_layers == 8 and s.status == "idle"
        t0 = time.monotonic()
        target = s.run(40)
        assert target == 40 and time.monotonic() - t0 < 5  # run() returns at once
        assert s.status == "running"
        s.wait(3, timeout=60)
        paused_at = s.pause()
        assert s.status == "paused" and "paused" in repr(s)
        time.sleep(1.0)
        assert s.iteration == paused_at  # nothing ran while paused
        s.resume()
        assert s.status == "running"
        s.wait(6, timeout=60)
        switched = s.set_telemetry(False)
        s.wait(switched + 2, timeout=60)
        assert not [sp for sp in s.metrics.timeline() if sp.iteration > switched]
        s.set_telemetry(True)
        s.wait(switched + 5, timeout=60)
        s.pause()
        df = s.metrics.iterations
        assert list(df["iteration"]) == list(range(len(df)))
        assert df["loss"].iloc[-1] < df["loss"].iloc[0]  # the GPT learns
        assert (df["samples_per_s"] > 0).all()
        timeline = s.metrics.timeline(1)
        assert {sp.stage for sp in timeline} == {0, 1}
        assert {"forward", "backward", "send", "recv"} <= {sp.kind for sp in timeline}
        mem = s.metrics.memory
        assert set(mem["stage"]) == {0, 1} and (mem["params"] > 0).all() and (mem["activations"] > 0).all()
        if len(os.sched_getaffinity(0)) >= 2:  # each CPU stage keeps to its own core (runtime/device.pin_cores)
            masks = [_cores(pid) for pid in s.processes.pids().values()]
            assert all(len(m) == 1 for m in masks) and masks[0] != masks[1]
        profile = s.profile()
        assert isinstance(profile, ModelProfile) and len(profile) == 8
        assert all(x.forward_s > 0 and x.backward_s > 0 and x.activation_bytes > 0 for x in profile.layers)
        # The measured profile is what the planners take.
        p = plan(profile, Cluster(2, 10**12, 1e9, 1e9), microbatches=4, method="vpipe")
        assert p.num_layers == 8
    iteration_events = [e for e in events if e["type"] == "iteration"]
    assert len(iteration_events) >= 8 and iteration_events[0]["spans"] and iteration_events[0]["memory"]
    with pytest.raises(SessionClosed):
        s.run(1)
    assert "stopped" in repr(s) and s.status == "stopped"


def test_where_time_goes_measured_beside_predicted() -> None:
    """session.breakdown(): each stage's measured split of its recent iterations beside the simulator's split of the
    running plan, a DataFrame by stage with the bottleneck marked in each."""
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60) as s:
        s.run(8)
        s.wait(timeout=120)
        frame = s.breakdown(last=5)
        chunks = s.breakdown(last=5, chunks=True)
    assert list(frame["stage"]) == [0, 1]
    parts = ["compute", "recompute", "swap", "transfer", "bubble"]
    for prefix in ("", "predicted_"):
        assert frame[f"{prefix}bottleneck"].sum() == 1
        total = sum(frame[f"{prefix}{p}_s"] for p in parts)  # every policy is keep: the parts fill the iteration
        assert list(total) == pytest.approx(list(frame[f"{prefix}iteration_s"]), rel=1e-6)
        assert (frame[f"{prefix}compute_share"] > 0.05).all()
    assert (frame["recompute_s"] == 0).all() and (frame["swap_s"] == 0).all()
    # one chunk per stage: each chunk's row is its stage's work
    assert list(chunks["chunk"]) == [0, 0] and list(chunks["compute_s"]) == pytest.approx(list(frame["compute_s"]))
    assert (chunks["predicted_compute_share"] > 0.05).all()


def test_waiting_for_an_iteration_the_session_will_not_reach_says_why_at_once() -> None:
    """Idle short of it, or paused: wait() raises at once with the reason and the fix; a timeout says where training
    stood when it expired, not when the wait began."""
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60) as s:
        s.run(3)
        assert s.wait(timeout=60) == 3
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"iteration 8 will not be reached: training stopped at iteration 3 "
                                               r"\(the target of the last run\(\)\).*run\(5\) first"):
            s.wait(8)  # no timeout: it used to block forever
        assert time.monotonic() - start < 5
        s.run()
        at = s.pause()
        with pytest.raises(RuntimeError, match=f"paused at iteration {at}: resume"):
            s.wait(at + 5)
        s.resume()
        begun = s.iteration
        with pytest.raises(TimeoutError, match=r"iteration 100000000 not reached \(at (\d+)\) within 2 s") as err:
            s.wait(10**8, timeout=2)
        assert int(err.value.args[0].split("(at ")[1].split(")")[0]) > begun  # where it stood at the end


def test_the_session_shows_users_the_names_the_architecture_page_lists() -> None:
    """The Session stays small: the public names of a running session (its class's and what its instance holds) are
    the list docs/architecture.md gives, and the names it deprecated for one release, no more, no fewer (a name
    added to the class or set on the instance, or left in the page after it went, fails here)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    section = page[page.index("## The Session and its collaborators"):page.index("The rest it hands out")]
    listed = set(re.findall(r"`([a-z_]+)`", section.split("fails):", 1)[1].split("Deprecated", 1)[0]))
    deprecated = set(re.findall(r"`([a-z_]+)`", section.split("Deprecated", 1)[1]))
    handed = {"metrics", "record", "processes"}  # the collaborators it hands out (the diagram below the list)
    with vpipe_lab.launch("mlp", stages=2, device="cpu") as session:
        public = {name for name in dir(session) if not name.startswith("_")}
    assert public == listed | deprecated | handed, (sorted(public - listed - deprecated - handed),
                                                    sorted((listed | deprecated | handed) - public))
    assert f"{len(listed)} in all" in section
    with pytest.warns(DeprecationWarning, match=r"Session.stages is deprecated .* use session.plan.stages"):
        assert session.stages == 2
