"""A stage's checkpoints: what it saves restores bit for bit (parameters, optimizer state, group options), a write
that fails is reported and switches nothing, and a checkpoint of another model is refused by name."""

from pathlib import Path

import pytest
import torch

from tests.full_disk import small_filesystem
from vpipe_lab.runtime.disk import checkpoints
from vpipe_lab.runtime.disk.checkpoints import Checkpoints
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.wire.checkpoint_format import Manifest, resolve


class OnePeer:
    """A pipeline of one stage: every agreement is this rank's own vote."""

    def all_max(self, values: list[float]) -> list[float]:
        return values


def trained_stage() -> Stage:
    torch.manual_seed(0)
    stage = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p, lr=0.1), 0)
    for i in range(2):
        stage.add_layer(i, torch.nn.Linear(3, 3))
    for _ in range(2):
        x = torch.ones(4, 3)
        for i in stage.owned:
            x = stage.layers[i].module(x)
        x.sum().backward()
        stage.step()
        stage.zero_grad()
    return stage


def manifest(iteration: int = 5) -> Manifest:
    return Manifest(iteration, {"boundaries": [0, 2], "policies": ["keep", "keep"], "microbatches": 1}, 2,
                    ["0:Linear", "1:Linear"], 0, 1, 0)


def test_save_then_restore_continues_bit_for_bit(tmp_path: Path) -> None:
    stage = trained_stage()
    saver = Checkpoints(OnePeer(), stage, 0, 1, 0, True, torch.device("cpu"))  # type: ignore[arg-type]
    assert saver.save(tmp_path / "ckpt-v1", manifest, keep=None, iteration=5) is None
    fresh = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p, lr=0.1), 0)
    torch.manual_seed(1)
    for i in range(2):
        fresh.add_layer(i, torch.nn.Linear(3, 3))
    loaded = Checkpoints(OnePeer(), fresh, 0, 1, 0, True, torch.device("cpu")).restore(tmp_path, 2)  # type: ignore[arg-type]
    assert loaded.iteration == 5 and loaded.plan_version == 1
    for s in (stage, fresh):  # one more identical step on both
        x = torch.ones(4, 3)
        for i in s.owned:
            x = s.layers[i].module(x)
        x.sum().backward()
        s.step()
    for name, value in stage.tensors.items():
        assert torch.equal(value, fresh.tensors[name]), name


def test_a_failed_write_is_reported_and_a_wrong_model_refused(tmp_path: Path) -> None:
    stage = trained_stage()
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    saver = Checkpoints(OnePeer(), stage, 0, 1, 0, True, torch.device("cpu"))  # type: ignore[arg-type]
    problem = saver.save(blocked / "ckpt-v1", manifest, keep=None, iteration=5)
    assert problem is not None and "stage 0 cannot write" in problem
    assert saver.save(tmp_path / "ok" / "ckpt-1", manifest, keep=None, iteration=5) is None
    with pytest.raises(ValueError, match="holds 2 layers but the model has 3"):
        saver.restore(tmp_path / "ok", 3)


def test_a_full_disk_is_one_line_the_partial_version_is_removed_and_the_previous_one_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/security.md: torch's writer meets a real full file system (its CheckpointException is a BaseException,
    its inner error "unexpected pos 704 vs 598"); the save says no space was left, where, and removes what it wrote."""
    stage = trained_stage()
    saver = Checkpoints(OnePeer(), stage, 0, 1, 0, True, torch.device("cpu"))  # type: ignore[arg-type]
    with small_filesystem(tmp_path, 256) as disk:
        if disk is None:
            pytest.skip("this machine cannot mount a small file system; the injected ENOSPC test covers the path")
        assert saver.save(disk / "ckpt" / "ckpt-1", manifest, keep=None, iteration=5) is None
        first = resolve(disk / "ckpt")
        big = torch.nn.Linear(400, 400)  # 640 KiB of weights: more than the 256 KiB disk holds
        stage.add_layer(2, big)
        # the early check (what it writes against what is free) is passed over, so torch's writer meets the full disk
        monkeypatch.setattr(checkpoints, "state_bytes", lambda state: 0)
        problem = saver.save(disk / "ckpt" / "ckpt-2", manifest, keep=None, iteration=6)
        assert problem is not None and "\n" not in problem
        assert "no space left on the device that holds" in problem and "ckpt-2" in problem, problem
        assert not (disk / "ckpt" / "ckpt-2").exists()  # its partial files are gone: the disk has its space back
        assert resolve(disk / "ckpt") == first and Manifest.read(disk / "ckpt").iteration == 5
        monkeypatch.undo()
        problem = saver.save(disk / "ckpt" / "ckpt-3", manifest, keep=None, iteration=6)  # refused before writing
        assert problem is not None and problem.startswith("no space left for stage 0's") and "free there" in problem
        assert not (disk / "ckpt" / "ckpt-3").exists()


def test_units_written_by_two_stages_load_into_one_from_both_directories(tmp_path: Path) -> None:
    """A job going on with fewer stages: each unit, and its optimizer state, is read from the stage that held it."""
    whole = trained_stage()
    dirs = []
    for index in (0, 1):  # two stages, one layer each, write their own DCP directory (as restart snapshots are)
        part = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p, lr=0.1), 0)
        part.add_layer(index, whole.layers[index].module)
        part.load_optimizer(whole.optimizer_state(list(part.layers[index].names)), [])
        where = tmp_path / f"stage-{index}"
        torch.distributed.checkpoint.save(Checkpoints(OnePeer(), part, index, 2, 0, True,  # type: ignore[arg-type]
                                                      torch.device("cpu")).state(7), checkpoint_id=str(where),
                                          no_dist=True)
        dirs.append(where)
    torch.manual_seed(3)
    fresh = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p, lr=0.1), 0)
    for i in range(2):
        fresh.add_layer(i, torch.nn.Linear(3, 3))
    reader = Checkpoints(OnePeer(), fresh, 0, 1, 0, True, torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"has no 1\.weight, 1\.bias"):  # one directory lacks layer 1: nothing read
        reader.load_directory([dirs[0]])
    assert not torch.equal(fresh.tensors["0.weight"], whole.tensors["0.weight"])
    reader.load_directory(dirs)
    for name, value in whole.tensors.items():
        assert torch.equal(value, fresh.tensors[name]), name
    for name, state in whole.optimizer_state(list(whole.tensors)).items():
        got = fresh.optimizer_state([name])[name]
        assert all(torch.equal(v, got[k]) for k, v in state.items() if isinstance(v, torch.Tensor)), name
