"""The path of one live change in the controller: what an editor Apply calls, checks and asks of the workers.

    python benchmarks/change_path.py

A 2-stage MLP session with a memory budget trains two iterations and measures a profile; an editor over it then
gets a drag (a draft), the same draft again and Apply (layer 3 swapped, the boundary moved). The editor's thread is
traced from the Apply message to the applied status: the lab's functions it runs (distinct, and in how many
modules), how often a plan is checked (``Plan._check``, the work behind ``validate``), how many previews are
computed (cost model + simulator) and how many times the workers are asked for a profile. The workers' side is
read from the code: each rank decodes the Apply body into a Plan and checks it once (``worker_commands._apply_plan``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import vpipe_lab
from vpipe_lab.core.plan import Plan
from vpipe_lab.jupyter import partition_widget
from vpipe_lab.jupyter.partition_widget import PartitionEditor

PACKAGE = str(Path(vpipe_lab.__file__).parent)
PATH = ("jupyter/", "control/", "wire/", "core/change.py", "core/plan.py")  # the modules a change travels through


def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("the editor did not get there")
        time.sleep(0.01)


def main() -> None:
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", memory_budget=1 << 34, timeout=60) as s:
        s.run(2)
        s.wait(timeout=60)
        s.profile()
        counts = {"checks": 0, "previews": 0, "profile requests": 0}
        calls: set[tuple[str, str]] = set()
        tracing = threading.Event()

        def trace(frame: FrameType, event: str, _arg: Any) -> None:
            if tracing.is_set() and event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
                calls.add((frame.f_code.co_filename[len(PACKAGE) + 1:], frame.f_code.co_qualname))

        # Run against an older checkout (before the typed change path) this counts its validate() calls instead.
        checker = "_check" if hasattr(Plan, "_check") else "validate"
        real_check, real_estimate, real_layers = getattr(Plan, checker), partition_widget.estimate, s._layers
        setattr(Plan, checker, lambda plan, *a: (counts.__setitem__("checks", counts["checks"] + 1),
                                                 real_check(plan, *a))[1])
        partition_widget.estimate = lambda *a, **k: (counts.__setitem__("previews", counts["previews"] + 1),
                                                     real_estimate(*a, **k))[1]
        s._layers = lambda *a, **k: (counts.__setitem__("profile requests", counts["profile requests"] + 1),  # type: ignore[method-assign]
                                     real_layers(*a, **k))[1]
        at_change: dict[str, int] = {}
        door = "change" if hasattr(s, "change") else "apply"
        real_change = getattr(s, door)

        def change(*a: Any, **k: Any) -> Any:
            at_change.update(counts)  # what the path asked before the workers acknowledged
            try:
                return real_change(*a, **k)
            finally:
                at_change["profile requests after"] = counts["profile requests"]

        setattr(s, door, change)
        threading.setprofile(trace)  # the editor's thread starts after this
        ed = PartitionEditor(s)
        try:
            wait_for(lambda: "current" in ed.preview)
            for key in counts:
                counts[key] = 0
            policies = ["keep"] * 10
            policies[3] = "swap"
            tracing.set()
            for kind in ("draft", "draft", "apply"):
                ed.receive({"kind": kind, "boundaries": [0, 3, 10], "policies": policies})
            wait_for(lambda: ed.status.get("state") == "applied")
            tracing.clear()
            wait_for(lambda: counts["profile requests"] > at_change["profile requests after"])  # the re-measure
        finally:
            threading.setprofile(None)
            ed.close()
        files = {f for f, _ in calls}
        path = {(f, q) for f, q in calls if f.startswith(PATH) and "<" not in q}
        print(f"editor drag, same draft, Apply -> {ed.status['message']}")
        print(f"lab functions run on the editor's thread: {len(calls)} distinct, in {len(files)} modules; the path "
              f"itself (no cost model, simulator, metrics): {len(path)} functions in {len({f for f, _ in path})} "
              "modules")
        print(f"plan checks (Plan.{checker}) in the controller: {counts['checks']}")
        print(f"previews computed (cost model + simulator): {counts['previews']}")
        before, after = at_change["profile requests"], at_change["profile requests after"]
        print(f"profile requests to the workers: {before} by the previews, {after - before} by session.{door}(), "
              f"{counts['profile requests'] - after} after it (the editor re-measuring its blocks)")
        for f in sorted(files):
            print(f"  {f}: {', '.join(sorted(q for g, q in calls if g == f))}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
