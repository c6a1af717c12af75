"""What the workers send: the bodies the controller files, with the fields it reads."""

from tests.messages import ready, report
from vpipe_lab.core.profile import LayerCost
from vpipe_lab.core.settings import Settings
from vpipe_lab.wire.codec import decode
from vpipe_lab.wire.events import (
    Current,
    Failure,
    Hello,
    JobInfo,
    LayerMeasure,
    Layers,
    Migrated,
    Units,
    Welcome,
)


def test_worker_reports_round_trip() -> None:
    bodies = [Hello(0, 123, "host"), Units(0, ["0:a", "1:b"]), ready(1), report(3, 1, losses=[0.5], sizes=[4]),
              Layers(2, 1, [LayerMeasure(4, LayerCost("x", 0.1, 0.2, 1, 2, 3, 4, 5, ((2, 0.05, 0.1),)), 6)]),
              Migrated(0, 2, 9, 100, 0.1, 0.05, [3], [], (1.0, 1.1)),
              Failure("exception", 1, rank=1, cause="RuntimeError: x", traceback="tb")]
    for body in bodies:
        assert decode(body.message()) == body


def test_a_welcome_carries_typed_ready_reports_and_the_current_view() -> None:
    job = JobInfo("s", Settings(stages=2, microbatches=4, device="cpu", timeout=30.0, memory_budget=(1, 2)).to_json())
    welcome = Welcome(job, [ready(0), ready(1)], Current({"kind": "plan"}, 1, ["a"], 5, True, None), 3)
    got = decode(welcome.message("broker"))
    assert got == welcome
    spec = job.to_spec("key", "tcp://x:1")
    assert spec.settings.stages == 2 and spec.settings.memory_budget == (1, 2) and spec.session_id == "s"
