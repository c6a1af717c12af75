"""``%vpipe export`` and ``%vpipe import`` on a running session: the bundle is written, a Megatron-LM layout and a
torchtitan TOML come in as plans with the lab's comparison and an editor over them; bad sources are usage errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

from vpipe_lab.jupyter.magics import build_parser
from vpipe_lab.jupyter.partition_widget import PartitionEditor
from vpipe_lab.wire import bundle_files


def test_the_parser_takes_both_commands() -> None:
    args = build_parser().parse_args(["import", "Et|tL", "--ranks", "2", "--microbatches", "8", "--apply"])
    assert (args.source, args.ranks, args.microbatches, args.apply, args.name) == ("Et|tL", 2, 8, True, "imported")
    assert build_parser().parse_args(["export", "out", "--plan", "p"]).plan == "p"


@pytest.mark.slow
def test_export_and_import_on_a_session(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ip = globalipapp.start_ipython() or globalipapp.get_ipython()  # one shell, whichever module came first
    ip.run_line_magic("load_ext", "vpipe_lab")
    try:
        ip.run_line_magic("vpipe", "start mlp --stages 2 --microbatches 4 --device cpu --run 3 --name pipe")
        ip.run_line_magic("vpipe", "wait 3 --timeout 120")
        path = ip.run_line_magic("vpipe", f"export {tmp_path / 'b'}")
        assert bundle_files.read(path).plan == ip.user_ns["pipe"].plan
        ip.user_ns["parts"] = [["0", "1", "2"], ["3", "4", "5", "6", "7", "8", "9"]]
        editor = ip.run_line_magic("vpipe", "import parts --name prod")
        assert ip.user_ns["prod"].boundaries == (0, 3, 10) and isinstance(editor, PartitionEditor)
        deadline = time.monotonic() + 20
        while not editor.preview and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "draft" in editor.preview  # the what-if of the imported plan
        toml = tmp_path / "titan.toml"
        toml.write_text('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "GPipe"\n'
                        'module_fqns_per_model_part = [["0", "1", "2", "3", "4", "5"], ["6", "7", "8", "9"]]\n'
                        'pipeline_parallel_microbatch_size = 8\n')
        ip.run_line_magic("vpipe", f"import {toml} --batch-size 32 --apply")
        assert ip.user_ns["pipe"].plan.boundaries == (0, 6, 10) and ip.user_ns["pipe"].plan.schedule == "gpipe"
        with pytest.raises(UsageError, match=r"splits unit|no part"):
            ip.user_ns["bad"] = [["0", "1"], ["2"]]
            ip.run_line_magic("vpipe", "import bad")
        out = capsys.readouterr().out
        assert "exported to" in out and "imported plan: " in out and "in effect from iteration" in out
    finally:
        ip.run_line_magic("vpipe", "stop")
