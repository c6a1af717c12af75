"""The replies both engines send (acknowledgements, the job as it is now, run/pause/stop/save) and the lab engine's
command table, on a stand-in worker: what rank 0 sends, what the others do not, and every command has a handler."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vpipe_lab.core.plan import Plan
from vpipe_lab.runtime.progress import Control
from vpipe_lab.runtime.worker_commands import Replies, WorkerCommands
from vpipe_lab.wire import commands as C
from vpipe_lab.wire import events as E
from vpipe_lab.wire.codec import Body


class Host:
    """The members ``Replies`` reads of a worker, and what it sent."""

    def __init__(self, leader: bool) -> None:
        self.leader, self.ctl, self.plan = leader, Control(iteration=4, target=4), Plan((0, 2, 4), ("keep",) * 4, 2)
        self.names = ["a", "b", "c", "d"]
        self.chain = SimpleNamespace(infos=lambda: [{"name": n} for n in self.names])
        self.link = SimpleNamespace(drain=lambda wait_s: [])
        self.sent: list[Body] = []
        self.saved: list[tuple[Path, str | None, int | None]] = []

    def send(self, body: Body) -> None:
        self.sent.append(body)

    def save(self, root: Path, name: str | None = None, keep: int | None = None) -> str | None:
        self.saved.append((root, name, keep))
        return None if name != "full" else "no space left on the device"


def test_rank_0_acknowledges_a_run_and_says_where_the_job_stands_and_other_ranks_stay_quiet() -> None:
    host = Host(leader=True)
    replies = Replies(host)  # type: ignore[arg-type]
    replies.run(C.Run(iterations=3))
    assert (host.ctl.target, host.ctl.paused) == (7, False)  # three more from iteration 4
    ack, current = host.sent
    assert isinstance(ack, E.Ack) and (ack.command, ack.iteration, ack.target) == ("run", 4, 7)
    assert isinstance(current, E.Current) and current.names == host.names and current.target == 7
    assert current.plan == host.plan.to_dict() and not current.running
    replies.run_state(C.Pause())
    assert host.ctl.paused and isinstance(host.sent[-1], E.Current) and host.sent[-1].paused
    quiet = Host(leader=False)
    Replies(quiet).run(C.Run(iterations=None))  # type: ignore[arg-type]
    assert quiet.sent == [] and quiet.ctl.target is None  # it runs until stopped all the same


def test_a_save_is_acknowledged_with_its_path_and_its_failure_in_words() -> None:
    host = Host(leader=True)
    replies = Replies(host)  # type: ignore[arg-type]
    replies.save(C.Save(path="/ckpt", name="full", keep=2))
    (ack,) = host.sent
    assert host.saved == [(Path("/ckpt"), "full", 2)]
    assert isinstance(ack, E.Ack) and (ack.path, ack.ok, ack.error) == ("/ckpt", False, "no space left on the device")


def test_every_command_the_controller_sends_has_a_handler_in_the_lab_engine_s_table() -> None:
    table: dict[type[Body], Any] = WorkerCommands(SimpleNamespace(), Replies(Host(True))).table()  # type: ignore[arg-type]
    commands = {c for c in vars(C).values() if isinstance(c, type) and issubclass(c, C.Command) and c is not C.Command}
    assert commands <= set(table), commands - set(table)
