from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

from vpipe_lab.jupyter.magics import COMMANDS, build_parser, complete


@pytest.fixture(scope="module")
def ip():  # type: ignore[no-untyped-def]
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()  # one shell, whichever module came first
    shell.run_line_magic("load_ext", "vpipe_lab")
    yield shell
    shell.run_line_magic("vpipe", "stop")


def test_help_lists_every_command(ip, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    ip.run_line_magic("vpipe", "help")
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


def test_bad_input_is_a_usage_error(ip) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="invalid choice: 'bogus'"):
        ip.run_line_magic("vpipe", "bogus")
    with pytest.raises(UsageError, match="no running session"):
        ip.run_line_magic("vpipe", "pause")
    with pytest.raises(UsageError, match="'nothing_here' is neither a bundled example \\(mlp, gpt-tiny, moe-tiny\\) nor a "
                                         "notebook variable"):
        ip.run_line_magic("vpipe", "start nothing_here")
    with pytest.raises(UsageError, match=r"'gpt-tiny' has 8 partition units.*not 20"):  # before any worker starts
        ip.run_line_magic("vpipe", "start gpt-tiny --stages 20")
    with pytest.raises(UsageError, match="stages must be a whole number >= 1, got 0"):
        ip.run_line_magic("vpipe", "start mlp --stages 0")
    with pytest.raises(UsageError, match="virtual_stages must be a whole number >= 1 or None, got 0"):
        ip.run_line_magic("vpipe", "start mlp --schedule interleaved-1f1b --virtual-stages 0")
    with pytest.raises(UsageError, match=r"virtual_stages=2 needs a chunked schedule, not '1f1b' \(the chunked ones: "):
        ip.run_line_magic("vpipe", "start mlp --virtual-stages 2")
    with pytest.raises(UsageError, match="there is no module 'no_such_package'"):  # as vpipe-lab run names parts
        ip.run_line_magic("vpipe", "start no_such_package.models:build --data mlp")
    ip.user_ns["not_a_session"] = 3
    with pytest.raises(UsageError, match="holds a int, not a vpipe_lab Session"):
        ip.run_line_magic("vpipe", "use not_a_session")
    with pytest.raises(UsageError, match="is not a size"):
        ip.run_line_magic("vpipe", "start mlp --budget lots")
    # a misspelt option: that sub-command's usage and the option it is closest to, not the list of sub-commands
    with pytest.raises(UsageError, match=r"(?s)%vpipe start: unrecognized arguments: --stags 2 \(did you mean "
                                         r"--stages\?\).*usage: %vpipe start"):
        ip.run_line_magic("vpipe", "start gpt-tiny --stags 2")
    with pytest.raises(UsageError, match=r"cannot read the line '.*': No closing quotation"):
        ip.run_line_magic("vpipe", 'start "unterminated')
    ip.user_ns.pop("session", None)
    with pytest.raises(UsageError, match=r"--run 'banana': give a number of iterations \(>= 1\) or 'forever'"):
        ip.run_line_magic("vpipe", "start gpt-tiny --run banana")
    assert "session" not in ip.user_ns  # refused before any worker started: nothing bound


def test_split_option_takes_module_names_or_a_function(ip) -> None:  # type: ignore[no-untyped-def]
    magics = ip.magics_manager.registry["VpipeMagics"]
    assert build_parser().parse_args(["start", "m", "--split", "a.1,a.3"]).split == "a.1,a.3"
    assert magics._split("transformer.h.2, transformer.h.4") == ["transformer.h.2", "transformer.h.4"]
    ip.user_ns["cut"] = lambda name, module: name.endswith(".3")
    assert magics._split("cut") is ip.user_ns["cut"]
    assert magics._split("lm_head") == ["lm_head"] and magics._split(None) is None


def test_completion() -> None:
    assert set(complete(None, SimpleNamespace(line="%vpipe "))) == set(COMMANDS)
    assert complete(SimpleNamespace(user_ns={"a": 1}), SimpleNamespace(line="%vpipe use ")) == []
    assert "gpt-tiny" in complete(None, SimpleNamespace(line="%vpipe start "))
    assert "recompute" in complete(None, SimpleNamespace(line="%vpipe policy 3="))
    from vpipe_lab.core import schedules
    from vpipe_lab.core.planning.methods import METHODS

    assert set(complete(None, SimpleNamespace(line="%vpipe plan --method "))) == set(METHODS)
    assert set(complete(None, SimpleNamespace(line="%vpipe start gpt-tiny --schedule "))) == set(schedules.names())
    assert {"--method", "--apply"} <= set(complete(None, SimpleNamespace(line="%vpipe plan ")))
    assert "--budget" in complete(None, SimpleNamespace(line="%vpipe start gpt-tiny "))
    assert build_parser().parse_args(["partition", "0", "4", "10"]).boundaries == [0, 4, 10]


@pytest.mark.slow
def test_a_session_driven_from_magics(ip, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import torch

    ip.user_ns["halve"] = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ip.run_line_magic("vpipe", "start mlp --stages 2 --microbatches 4 --device cpu --run 4 --name pipe "
                      "--lr-scheduler halve --clip-grad-norm 5 --eval-data mlp --eval-every 2")
    pipe = ip.user_ns["pipe"]
    assert ip.run_line_magic("vpipe", "wait 4 --timeout 120") >= 4
    frame = pipe.metrics.iterations
    assert list(frame["lr"][:4]) == [0.05, 0.05, 0.025, 0.025] and frame["grad_norm"].notna().all()
    value = ip.run_line_magic("vpipe", "eval mlp --batches 2")
    assert value > 0 and pipe.metrics.evaluations["loss"].iloc[-1] == value
    ip.run_line_magic("vpipe", "policy 3=swap 4=recompute")
    ip.run_line_magic("vpipe", "partition 0 4 10")
    assert pipe.plan.boundaries == (0, 4, 10) and pipe.plan.policies[3].value == "swap"
    with pytest.raises(UsageError, match="write LAYER=POLICY"):
        ip.run_line_magic("vpipe", "policy three=swap")
    with pytest.raises(UsageError, match="PlanError"):
        ip.run_line_magic("vpipe", "partition 0 0 10")
    with pytest.raises(UsageError, match=r"the iteration to wait for must be a whole number >= 0 or None .*got -3"):
        ip.run_line_magic("vpipe", "wait -3")
    version = pipe.applied[-1].version
    ip.run_line_magic("vpipe", "partition 0 4 10")  # the plan in force again: said so, no new version
    said = capsys.readouterr().out
    assert pipe.applied[-1].version == version and "already in force: nothing changed" in said
    found = ip.run_line_magic("vpipe", "plan")
    assert found.plan.num_layers == 10
    mesh = ip.run_line_magic("vpipe", "plan --devices 4")  # the mesh for 4 devices, from this job's measured profile
    assert mesh.result.plan.devices == 4 and mesh.result.plan.num_layers == 10
    with pytest.raises(UsageError, match="runs after a restart: drop --apply"):
        ip.run_line_magic("vpipe", "plan --devices 4 --apply")
    ip.run_line_magic("vpipe", "run 2")
    ip.run_line_magic("vpipe", "wait --timeout 120")
    trace = tmp_path / "trace.json"
    ip.run_line_magic("vpipe", f"trace {trace}")
    assert any(e.get("cat") == "forward" for e in json.loads(trace.read_text())["traceEvents"])
    board = ip.run_line_magic("vpipe", "dashboard")
    editor = ip.run_line_magic("vpipe", "editor")
    deadline = time.monotonic() + 20
    while (board.refreshes == 0 or not editor.layers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert board.refreshes >= 1 and len(editor.layers) == 10 and editor.boundaries == [0, 4, 10]
    ip.run_line_magic("vpipe", "status")
    saved = pipe.save(tmp_path / "ckpt")
    ip.run_line_magic("vpipe", "stop")
    out = said + capsys.readouterr().out
    assert "bound to `pipe`" in out and "stopped; no worker process is left" in out
    assert "evaluation loss" in out
    # --resume, as launch(resume=...) and vpipe-lab run --resume: onto 3 stages, at the iteration it was saved
    ip.run_line_magic("vpipe", f"start mlp --stages 3 --microbatches 4 --device cpu --resume {tmp_path / 'ckpt'} "
                      "--name again")
    again = ip.user_ns["again"]
    from vpipe_lab.wire.checkpoint_format import Manifest

    assert again.iteration == Manifest.read(saved).iteration == 6 and again.plan.stages == 3
    ip.run_line_magic("vpipe", "stop")


@pytest.mark.slow
def test_a_session_started_from_python_is_the_one_the_magics_act_on(ip, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import vpipe_lab

    shell = ip
    with vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu") as first:
        shell.run_line_magic("vpipe", "partition 0 3 10")  # no %vpipe start: the newest running session
        assert first.plan.boundaries == (0, 3, 10)
        with vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu") as second:
            shell.user_ns["older"] = first
            shell.run_line_magic("vpipe", "use older")
            shell.run_line_magic("vpipe", "partition 0 6 10")
            assert first.plan.boundaries == (0, 6, 10) and second.plan.boundaries == (0, 5, 10)
            assert "older" in complete(shell, SimpleNamespace(line="%vpipe use "))
    assert "now act on `older`" in capsys.readouterr().out
