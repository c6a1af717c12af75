"""A sharded stage's units under FSDP2 on two gloo ranks: each sharding choice gathers and reduces when it says,
and a stage of two shards takes the step one process takes over the whole batch; a unit leaves as a plain shell."""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.runtime.engine.test_comm import _port, two_ranks
from vpipe_lab.core.sharding import Sharding
from vpipe_lab.runtime.engine.shards import Shards, is_sharded, like, local, unwrap, whole
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model.capture import UnitTensors

assert _port  # the helpers come with test_comm's two spawned ranks


def units() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh()), torch.nn.Linear(10, 3)]


def tensors(unit: torch.nn.Module, i: int) -> UnitTensors:
    return UnitTensors([(n, f"{i}.{n}") for n, _ in unit.named_parameters()], [])


def float_of(ticks: Any) -> float:
    return float(next(ticks))


def _run(rank: int, port: int, out: dict) -> None:  # type: ignore[type-arg]
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    for mode in Sharding:  # one process group for every sharding: a stage of its own each
        stage = Stage(torch.device("cpu"), lambda p: torch.optim.SGD(p, lr=0.1), 0)
        stage.shard(Shards(mesh, set(), mode))
        for i, unit in enumerate(units()):
            stage.add_layer(i, unit, tensors(unit, i))
        assert all(is_sharded(p) for _, p in stage.params())
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
        shards = stage.shards
        assert shards is not None
        shards.clock = functools.partial(float_of, iter(range(1_000_000)))  # the spans the executor times, wherever
        # FSDP runs them
        for mb in x.chunk(2)[rank].chunk(2):  # this rank's half of the batch, in two micro-batches
            shards.gather([0, 1])
            h = mb
            for i in (0, 1):
                h = stage.layers[i].module(h)
            (h.pow(2).mean() / 2).backward()
            shards.after_backward([0, 1])
        shards.finish()
        assert not shards.live  # every unit resharded: nothing gathered is held after the iteration
        stage.step()
        gathers = sum(kind == "all_gather" for kind, *_ in shards.spans)
        reduces = sum(kind == "reduce_scatter" for kind, *_ in shards.spans)
        out[(mode.value, rank)] = {"gathers": gathers, "reduces": reduces,
                                   "state": {n: whole(t).detach().clone() for n, t in stage.tensors.items()}}
        layer = stage.remove_layer(1)
        unwrap(layer.module)
        out[(mode.value, f"plain{rank}")] = type(layer.module) is torch.nn.Linear and all(
            p.is_meta and not is_sharded(p) for p in layer.module.parameters())
    dist.destroy_process_group()


def test_two_shards_take_the_step_of_one_process_and_collect_when_their_sharding_says() -> None:
    out = two_ranks(_run)
    plain = units()
    optimizer = torch.optim.SGD([p for u in plain for p in u.parameters()], lr=0.1)
    for mb in torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).chunk(4):
        (plain[1](plain[0](mb)).pow(2).mean() / 4).backward()
    optimizer.step()
    expected = {f"{i}.{n}": p.detach() for i, u in enumerate(plain) for n, p in u.named_parameters()}
    for mode in Sharding:
        for rank in (0, 1):
            got = out[(mode.value, rank)]
            for name, value in expected.items():
                torch.testing.assert_close(got["state"][name], value, msg=lambda m, k=f"{mode} {name}": f"{k}: {m}")
            # two units: gathered once for the iteration, or before each forward and each backward of both
            # micro-batches where they are resharded; reduced per micro-batch or once
            assert got["gathers"] == (2 * 2 * 2 if mode.reshard_after_forward else 2), mode
            assert got["reduces"] == (2 * 2 if mode.reduce_per_microbatch else 2), mode
            assert out[(mode.value, f"plain{rank}")], mode


def test_a_shard_travels_as_a_plain_tensor_and_comes_back_laid_out_like_its_parameter() -> None:
    plain = torch.ones(3, 2)
    assert local(plain) is plain and whole(plain) is plain and like(plain, plain) is plain and not is_sharded(plain)


def _like(rank: int, port: int, out: dict) -> None:  # type: ignore[type-arg]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    unit = torch.nn.Linear(4, 5)
    fully_shard(unit, mesh=init_device_mesh("cpu", (2,)))
    weight: Any = unit.weight
    shard = torch.full(local(weight).shape, float(rank))
    back = like(shard, weight)
    out[rank] = (is_sharded(back), tuple(back.shape), whole(back).tolist(), like(torch.tensor(3.0), weight).dim())
    dist.destroy_process_group()


def test_an_optimizer_state_shard_becomes_a_dtensor_of_its_parameters_layout() -> None:
    out = two_ranks(_like)
    # rows 0-2 on rank 0, rows 3-4 on rank 1: FSDP's dim-0 chunks
    assert out[0] == out[1] == (True, (5, 4), [[0.0] * 4] * 3 + [[1.0] * 4] * 2, 0)
