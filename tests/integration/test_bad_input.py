"""Bad input gets a clear error naming the stage and the cause, never a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import vpipe_lab
from vpipe_lab.control.errors import DataError, WorkerError
from vpipe_lab.core.errors import PlanError
from vpipe_lab.examples import mlp

pytestmark = pytest.mark.slow


def single_block() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.out(x)


class Branchy(Blocks):
    """Python control flow on a tensor's value: no static graph to cut."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if x.sum() > 0 else -block(x)
        return self.out(x)


class SharedNorm(torch.nn.Module):
    """One BatchNorm used by the first and the last block: its running statistics cannot live on two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.blocks[0](x))
        x = self.blocks[2](self.blocks[1](x))
        return self.out(self.norm(x))


def data6(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 4), torch.randn(6, 2)


def vector_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean(dim=0)  # forgot to reduce over the features


def mismatched() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(5, 2))


def data4(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 4), torch.randn(8, 2)


def broken_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError(f"no data for iteration {iteration}")


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ranks launch() really starts (the real launcher, counted)."""
    from vpipe_lab.control.workers.processes import Launcher

    ranks: list[int] = []
    spawn = Launcher.spawn

    def counted(self: Launcher, rank: int, args: list[str]) -> None:
        ranks.append(rank)
        spawn(self, rank, args)

    monkeypatch.setattr(Launcher, "spawn", counted)
    return ranks


def test_more_stages_than_a_bundled_model_has_units_starts_nothing(spawned: list[int]) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"'mlp' has 10 partition units.*at most 10 stages, not 11"):
        vpipe_lab.launch("mlp", stages=11, microbatches=2, device="cpu", timeout=30, start_timeout=120)
    assert spawned == [] and time.monotonic() - start < 5


def test_more_stages_than_units_is_refused_before_more_than_one_worker_starts(spawned: list[int]) -> None:
    """A model the kernel has not seen: rank 0 cuts it alone; the other five never start. Launched again, it is
    refused before any worker starts."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"the model has 4 partition units \(blocks.0, blocks.1, blocks.2, out\).*"
                                         r"at most 4 stages, not 6"):
        vpipe_lab.launch(Blocks, data4, stages=6, microbatches=2, device="cpu", timeout=30)
    assert spawned == [0] and time.monotonic() - start < 30
    with pytest.raises(ValueError, match="not 5"):
        vpipe_lab.launch(Blocks, data4, stages=5, microbatches=2, device="cpu", timeout=30)
    assert spawned == [0]


def test_a_model_that_fits_starts_every_rank_after_the_scout(spawned: list[int]) -> None:
    with vpipe_lab.launch(Blocks, data6, stages=3, microbatches=2, device="cpu", timeout=30) as s:
        assert spawned == [0, 1, 2] and s.names == ["blocks.0", "blocks.1", "blocks.2", "out"]
        s.run(1)
        s.wait(timeout=60)


def test_a_stage_would_get_no_unit() -> None:
    """A model with no repeated blocks is one unit: two stages cannot share it."""
    with pytest.raises(WorkerError, match=r"the model has 1 partition units .* but the pipeline has 2 stages"):
        vpipe_lab.launch(single_block, data4, stages=2, microbatches=2, device="cpu", timeout=30)


def test_model_that_cannot_be_captured() -> None:
    with pytest.raises(WorkerError, match=r"torch.export could not capture Branchy.*data-dependent") as err:
        vpipe_lab.launch(Branchy, data4, stages=2, microbatches=2, device="cpu", timeout=30)
    assert "torch.cond" in str(err.value)


def test_split_point_that_does_not_exist() -> None:
    with pytest.raises(WorkerError, match=r"split point 'block.1' is not a submodule of Blocks; did you mean 'blocks.1'"):
        vpipe_lab.launch(Blocks, data4, stages=2, microbatches=2, device="cpu", timeout=30, split=["block.1"])


def test_a_shared_buffer_that_cannot_be_split_across_stages() -> None:
    with pytest.raises(WorkerError, match=r"buffer 'norm.running_mean' is shared by units .* keep those units on one"):
        vpipe_lab.launch(SharedNorm, data4, stages=2, microbatches=2, device="cpu", timeout=30)


def data3(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 4), torch.randn(3, 2)


def test_batch_with_fewer_samples_than_microbatches() -> None:
    with pytest.raises(WorkerError, match="batch size 3, fewer samples than the 4 micro-batches"):
        vpipe_lab.launch(Blocks, data3, stages=2, microbatches=4, device="cpu", timeout=30)


def test_loss_that_is_not_a_scalar() -> None:
    with vpipe_lab.launch(Blocks, data4, loss=vector_loss, stages=2, microbatches=2, device="cpu", timeout=30) as s:
        assert s.names == ["blocks.0", "blocks.1", "blocks.2", "out"]
        s.run(1)
        with pytest.raises(WorkerError) as err:
            s.wait(timeout=60)
    assert err.value.stage == 1 and "the loss must return a scalar tensor, got (2,)" in str(err.value)
    assert str(err.value).startswith("stage 1 failed at iteration 0, micro-batch 0 (the loss): ValueError")


def test_data_function_that_raises() -> None:
    with vpipe_lab.launch(mlp.model, broken_data, stages=2, microbatches=2, device="cpu", timeout=30) as s:
        s.run(1)
        with pytest.raises(WorkerError) as err:
            s.wait(timeout=60)
    assert "no data for iteration 0" in str(err.value) and err.value.stage in (0, 1)


def test_shapes_that_do_not_match_between_stages() -> None:
    with vpipe_lab.launch(mismatched, data4, stages=2, microbatches=2, device="cpu", timeout=30) as s:
        s.run(1)
        with pytest.raises(WorkerError) as err:
            s.wait(timeout=60)
    assert err.value.stage == 1 and "shapes cannot be multiplied" in str(err.value)


def test_arguments_are_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="stages must be"):
        vpipe_lab.launch("mlp", stages=0, microbatches=2)
    with pytest.raises(ValueError, match="unknown example 'resnet'"):
        vpipe_lab.launch("resnet", stages=2, microbatches=2)
    with pytest.raises(ValueError, match="no data"):
        vpipe_lab.launch(mlp.model, stages=2, microbatches=2)
    with pytest.raises(ValueError, match="memory_budget"):
        vpipe_lab.launch("mlp", stages=2, microbatches=2, memory_budget=[1])
    with pytest.raises(PlanError, match="pipeline has 2"):
        vpipe_lab.launch("mlp", stages=2, microbatches=2, plan=vpipe_lab.Plan.from_counts([3, 3, 4], 2))
    with pytest.raises(ValueError, match=r"fused_wgrad must be True, False or .* got -1"):
        vpipe_lab.launch("mlp", stages=2, microbatches=2, fused_wgrad=-1)
    with pytest.raises(ValueError, match=r"fused_wgrad .* got 'yes'"):
        vpipe_lab.launch("mlp", stages=2, microbatches=2, fused_wgrad="yes")  # type: ignore[arg-type]


class NoNaN(torch.nn.Module):
    """Refuses a NaN in its input, as a user's sanity check inside a model would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.isnan(x).any():
            raise ValueError("a NaN reached the check")
        return x


def checked() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), NoNaN(), torch.nn.Linear(4, 2))


def nan_at_2(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 4)
    if iteration == 2:
        x[5, 1] = float("nan")  # sample 5 of 8: micro-batch 1 of 2
    return x, torch.randn(8, 2)


def test_a_workers_failure_names_its_iteration_micro_batch_and_unit() -> None:
    with vpipe_lab.launch(checked, nan_at_2, stages=2, microbatches=2, device="cpu", timeout=30) as s:
        s.run(5)
        with pytest.raises(WorkerError) as err:
            s.wait(timeout=60)
        assert s.status == "failed"
    e = err.value
    assert (e.stage, e.iteration, e.microbatch, e.action) == (1, 2, 1, "forward in unit 2 (2:NoNaN)")
    assert str(e).startswith("stage 1 failed at iteration 2, micro-batch 1 (forward in unit 2 (2:NoNaN)): ValueError: a NaN "
                             "reached the check")


class Tokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.out = torch.nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.out(x).flatten(0, 1)


def float_ids_at_3(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(iteration)
    ids = torch.randint(0, 16, (4, 6), generator=g)
    return {"input_ids": ids.float() if iteration == 3 else ids}, torch.randint(0, 16, (24,), generator=g)


def test_a_batch_unlike_the_first_pauses_training_as_bad_data_with_nothing_changed(tmp_path: Path) -> None:
    with vpipe_lab.launch(Tokens, float_ids_at_3, loss=torch.nn.functional.cross_entropy, stages=2, microbatches=2,
                          device="cpu", timeout=30, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as s:
        s.run(6)
        with pytest.raises(DataError) as err:
            s.wait(timeout=60)
        assert err.value.iteration == 3 and s.iteration == 3 and s.status == "paused"
        assert str(err.value).startswith(
            "the batch of iteration 3 is bad data: inputs['input_ids'] is float32 of shape [4, 6], where the first "
            "batch's was int64 of shape [4, 6]")
        before = s.state_dict()
        time.sleep(0.5)
        assert s.iteration == 3 and all(torch.equal(before[k], v) for k, v in s.state_dict().items())
        s.save(str(tmp_path / "kept"))  # the state is there to keep
        s.resume()  # the same batch is read and checked again
        with pytest.raises(DataError):
            s.wait(timeout=60)
        assert s.iteration == 3 and s.status == "paused"
