"""The registry: names to schedule objects, registration, and the one check of a job's schedule and settings."""

from __future__ import annotations

import pytest

from vpipe_lab.core import schedules
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules import ScheduleKind, Step
from vpipe_lab.core.schedules.actions import Op


class Forwards(ScheduleKind):
    name = "forwards-first"

    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        return [[(Op.F, s, m) for m in range(microbatches)] + [(Op.B, s, m) for m in range(microbatches)]
                for s in range(stages)]


def test_the_built_in_schedules_in_the_order_users_see() -> None:
    assert schedules.names()[:8] == ("gpipe", "1f1b", "eager-1f1b", "zb-h1", "interleaved-1f1b", "zbv", "dualpipev",
                                     "pipedream")
    assert [k.name for k in schedules.kinds() if k.chunked] == ["interleaved-1f1b", "zbv", "dualpipev"]
    assert [k.name for k in schedules.kinds() if k.split_backward] == ["zb-h1", "zbv", "dualpipev"]
    assert [k.name for k in schedules.kinds() if k.asynchronous] == ["pipedream"]


def test_register_and_unregister() -> None:
    kind = schedules.register(Forwards())
    try:
        assert schedules.get("forwards-first") is kind and schedules.added() == [kind]
        assert Plan((0, 1, 2), ("keep", "keep"), 2, "forwards-first").validate().kind is kind
        schedules.register(Forwards())  # the same class again: replaces it
        with pytest.raises(PlanError, match="taken by Forwards"):
            schedules.register(type("Other", (Forwards,), {})())
    finally:
        schedules.unregister("forwards-first")
    assert "forwards-first" not in schedules.names()
    with pytest.raises(PlanError, match="built in"):
        schedules.unregister("1f1b")
    with pytest.raises(PlanError, match="not 'auto'"):
        schedules.register(type("Auto", (Forwards,), {"name": "auto"})())
    with pytest.raises(PlanError, match="takes a ScheduleKind"):
        schedules.register("1f1b")  # type: ignore[arg-type]


def test_a_jobs_schedule_and_settings_are_refused_once_here() -> None:
    refuse = schedules.job_refusal
    assert refuse("1f1b", stages=2, microbatches=4) is None
    assert refuse("nope", stages=2, microbatches=4).startswith("unknown schedule 'nope'")  # type: ignore[union-attr]
    assert "multiple of 2" in refuse("interleaved-1f1b", stages=2, microbatches=3)  # type: ignore[operator]
    assert "at least 2 stages" in refuse("zbv", stages=1, microbatches=4)  # type: ignore[operator]
    assert "clip_grad_norm=1.0" in refuse("pipedream", stages=2, microbatches=4,  # type: ignore[operator]
                                          clip_grad_norm=1.0)
    assert refuse("1f1b", stages=2, microbatches=4, clip_grad_norm=1.0) is None
