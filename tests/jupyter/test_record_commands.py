"""``%vpipe history``, ``revert`` and ``compare`` on a real session: every plan that ran is in the record with what it
measured and (once a profile exists) what was predicted; a revert brings an entry's plan back by live migration; two
entries compare stage by stage; bad entries are usage errors."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.jupyter.history_panel import HistoryPanel
from vpipe_lab.jupyter.magics import build_parser


def test_the_parser_takes_the_commands() -> None:
    assert build_parser().parse_args(["revert", "2"]).entry == 2
    args = build_parser().parse_args(["compare", "0", "3"])
    assert (args.a, args.b) == (0, 3)


@pytest.mark.slow
def test_history_revert_and_compare_on_a_session(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ip = globalipapp.start_ipython() or globalipapp.get_ipython()  # one shell, whichever module came first
    ip.run_line_magic("load_ext", "vpipe_lab")
    try:
        ip.run_line_magic("vpipe", "start mlp --stages 2 --microbatches 4 --device cpu --run 12 --name pipe")
        pipe = ip.user_ns["pipe"]
        ip.run_line_magic("vpipe", "wait 12 --timeout 120")
        profile = pipe.profile()  # from now on each change is recorded with the cost model's prediction
        # calibrated by the running plan: its median over iterations 2..11 against its own simulation
        found = pipe.record.calibration(simulate(pipe.plan, profile, pipe.cluster()).iteration_s)
        assert found is not None and found.samples == 10
        assert found.measured_s == pytest.approx(statistics.median(r["time_s"] for r in pipe.metrics.records()[2:]))
        expected = found.apply(simulate(pipe.plan.with_boundaries((0, 3, 10)), profile, pipe.cluster()).iteration_s)
        ip.run_line_magic("vpipe", "partition 0 3 10")
        ip.run_line_magic("vpipe", "run 12")
        ip.run_line_magic("vpipe", "wait --timeout 120")
        panel = ip.run_line_magic("vpipe", "history")
        assert isinstance(panel, HistoryPanel) and "<td>magic</td>" in panel.table.value
        ip.run_line_magic("vpipe", "revert 0")
        assert pipe.plan.boundaries == (0, 5, 10) and pipe.processes.layers() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        editor = ip.run_line_magic("vpipe", "editor")
        assert [layer["name"] for layer in editor.layers] == pipe.names  # blocks at once, before any profile
        deadline = time.monotonic() + 30
        while not editor.layers and time.monotonic() < deadline:
            time.sleep(0.05)
        first = editor._profiled
        editor.reprofile_s = 0.5  # while training goes on, the editor measures its profile again by itself
        ip.run_line_magic("vpipe", "run 12")
        ip.run_line_magic("vpipe", "wait --timeout 120")
        assert editor._profiled > first
        # the editor's what-if is calibrated by the running plan's measured iterations, like the record's prediction
        wait = time.monotonic() + 30
        while "calibration" not in editor.preview and time.monotonic() < wait:
            time.sleep(0.05)
        shown = editor.preview
        assert shown["calibration"].startswith("x") and "the running plan measured" in shown["calibration"]
        factor = float(shown["calibration"][1:].split(":")[0])
        assert shown["current"]["iteration_s"] == pytest.approx(shown["current"]["simulated_s"] * factor, rel=1e-3)
        editor.close()
        frame = pipe.history
        assert list(frame["source"]) == ["launch", "magic", "revert"]
        assert list(frame["from_iteration"]) == [0, 12, 24] and list(frame["iterations"]) == [12, 12, 12]
        plans = list(frame["plan"])
        assert plans[0] == plans[2] != plans[1]
        assert (frame["median_s"] > 0).all() and (frame["samples_per_s"] > 0).all()
        assert math.isnan(frame["predicted_s"][0]) and (frame["predicted_s"][1:] > 0).all()
        assert frame["predicted_s"][1] == pytest.approx(expected)
        assert frame["error"][1:].abs().lt(10).all() and set(frame["bottleneck"]) <= {0, 1}
        both = pipe.compare(0, 1)
        assert list(both["stage"]) == [0, 1]
        for entry in (0, 1):  # each entry's split, entry 0's kept since iteration 12 rolled it out of the window
            shares = both[[f"{p}_share_{entry}" for p in ("compute", "recompute", "swap", "transfer", "bubble")]]
            assert ((shares.sum(axis=1) - 1).abs() < 0.05).all()
        assert pipe.record.entry_split(0)[1] is not None and {s.iteration for s in pipe.record.entry_split(0)[1]} == {11}
        view = ip.run_line_magic("vpipe", "compare 0 1")
        assert view.view.header["text"].startswith("entry 0 (launch)")
        with pytest.raises(UsageError, match="no entry 7"):
            ip.run_line_magic("vpipe", "revert 7")
        with pytest.raises(UsageError, match="no entry 9"):
            ip.run_line_magic("vpipe", "compare 0 9")
        text = ip.run_line_magic("vpipe", f"grid --csv {tmp_path / 'grid.csv'}")
        assert text.splitlines()[1].startswith("Step 0: 0F0")
        assert (tmp_path / "grid.csv").read_text().splitlines()[1] == "0,0F0,"
        ip.user_ns["gp"] = pipe.plan.replace(schedule="gpipe")
        gpipe = ip.run_line_magic("vpipe", "grid --plan gp")  # a draft held in a variable: every forward, then backwards
        assert len(gpipe.splitlines()) == 1 + 2 * (4 + 2 - 1) and gpipe.splitlines()[5].split()[2:] == ["1F3"]
        panel.close()
        view.close()
        # A drag while training goes on, with a profile older than fresh_s: the editor measures one first, and the
        # record's next prediction is made under the same (the session's newest); a fresh one is reused.
        fresh = ip.run_line_magic("vpipe", "editor")
        fresh.reprofile_s = 0.0  # only drags measure here
        wait_for = time.monotonic() + 30
        while "current" not in fresh.preview and time.monotonic() < wait_for:
            time.sleep(0.05)
        assert fresh._profiled == -math.inf  # it opened on the session's newest profile, not one of its own
        pipe.run(None)
        fresh.fresh_s = 0.0
        fresh.receive({"kind": "draft", "boundaries": [0, 4, 10], "policies": ["keep"] * 10})
        while fresh.draft_boundaries != [0, 4, 10] and time.monotonic() < wait_for:  # measured before it is shown
            time.sleep(0.05)
        measured_at = fresh._profiled
        assert measured_at > -math.inf and pipe.newest_profile() is fresh._profile
        fresh.fresh_s = 3600.0
        fresh.receive({"kind": "draft", "boundaries": [0, 6, 10], "policies": ["keep"] * 10})
        while fresh.draft_boundaries != [0, 6, 10] and time.monotonic() < wait_for:
            time.sleep(0.05)
        assert fresh.draft_boundaries == [0, 6, 10] and fresh._profiled == measured_at
        fresh.close()
    finally:
        ip.run_line_magic("vpipe", "stop")
    assert "entry 0's plan" in capsys.readouterr().out


def test_a_handler_reads_only_what_its_host_offers(capsys: pytest.CaptureFixture[str]) -> None:
    """The handlers are collaborators of the magic over ``MagicHost`` (the notebook's namespace, the views, the
    session, a variable by name), not mixins re-declaring it: any host that offers those runs them."""
    from types import SimpleNamespace

    from vpipe_lab.core.plan import Plan
    from vpipe_lab.jupyter.record_commands import RecordCommands

    class Host:
        def __init__(self) -> None:
            self.shell, self.views = SimpleNamespace(user_ns={"p": Plan.from_counts([2, 2], 4)}), []

        def need(self) -> object:
            raise AssertionError("--plan needs no session")

        def value(self, name: str, what: str) -> object:
            return self.shell.user_ns[name]

    text = RecordCommands(Host()).cmd_grid(build_parser().parse_args(["grid", "--plan", "p"]))
    assert "Step 9: 0B3" in text and "1f1b M=4 [0:2]KK [2:4]KK: 10 steps" in capsys.readouterr().out
