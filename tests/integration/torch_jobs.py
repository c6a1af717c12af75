"""Export bundles trained by torch.distributed.pipelining on 2 CPU ranks (gloo, 127.0.0.1), from the bundle alone:
the user's model, data and loss, ``vpipe_lab.export.torch_pipeline`` and torch's schedule. Optionally the schedule is
built by torchtitan's own builder from the bundle's ``torchtitan.toml``. Every rank's results come back in a file;
both processes are joined with a timeout and killed if they outlive it."""

from __future__ import annotations

import socket
import tomllib
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

V = 128  # the tiny GPT-2's vocabulary


def gpt2() -> torch.nn.Module:
    """A 4-layer GPT-2 without dropout (torch's split and the lab seed dropout differently) and with its embedding
    and LM head tied."""
    from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops

    allow_torchvision_without_ops()
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0,
                                      embd_pdrop=0, attn_pdrop=0, use_cache=False))


def gpt2_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + iteration)
    x = torch.randint(0, V, (8, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def gpt2_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def gpt2_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def moe() -> torch.nn.Module:
    """A 4-layer Qwen3-MoE (4 experts, top-2 per token) on the same tokens as the GPT-2."""
    from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops

    allow_torchvision_without_ops()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                              moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              max_position_embeddings=32, use_cache=False))


def parts(name: str) -> tuple[Any, Any, Any, Any]:
    """(model factory, data, loss, optimizer factory) of a model the jobs train: a bundled example, "gpt2" or
    "moe"."""
    if name == "gpt2":
        return gpt2, gpt2_data, gpt2_loss, gpt2_optimizer
    if name == "moe":
        return moe, gpt2_data, gpt2_loss, gpt2_optimizer
    from vpipe_lab.examples import get

    ex = get(name)
    return ex.model, ex.data, ex.loss, ex.optimizer


@dataclass(frozen=True)
class Job:
    bundle: str
    model: str = "mlp"
    iterations: int = 3
    use_csv: bool = False
    torchtitan: bool = False  # build the schedule with torchtitan's builder from the bundle's torchtitan.toml


@dataclass
class Result:
    losses: list[float]
    state: dict[str, torch.Tensor]
    orders: dict[int, list[str]] = field(default_factory=dict)  # rank -> the compute actions torch ran, in order


def _torchtitan_schedule(pp: Any, bundle: str, batch: int, loss: Any) -> Any:
    """torchtitan's own schedule builder over our stages, configured by the bundle's torchtitan.toml (torchtitan
    leaves the loss unscaled: the loss it gets is divided by the micro-batches here)."""
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import _build_pipeline_schedule

    settings = tomllib.loads((Path(bundle) / "torchtitan.toml").read_text())["parallelism"]
    config = ParallelismConfig(**settings)
    m = pp.bundle.microbatches
    return _build_pipeline_schedule(parallelism=config, local_batch_size=batch, stages=pp.stages,
                                    loss_fn=lambda out, y: (loss(out, y) / m, None))


def _worker(rank: int, port: int, jobs: list[Job], out: str, world: int = 2) -> None:
    import torch.distributed as dist

    from vpipe_lab.export import torch_pipeline
    from vpipe_lab.runtime.model.batches import split

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = []
    for job in jobs:
        model_fn, data, loss, optimizer = parts(job.model)
        torch.manual_seed(0)
        model = model_fn().train()
        x0, _ = data(0)
        dps = world // 2  # the data-parallel ranks (shards x replicas) of a 2-stage bundle: each its share
        pp = torch_pipeline(model, job.bundle, rank, loss_fn=loss, use_csv=job.use_csv,
                            example=split(split(x0, dps, "inputs")[rank // 2], _count(job.bundle), "inputs")[0])
        actions = pp.record()
        if job.torchtitan:
            pp.schedule = _torchtitan_schedule(pp, job.bundle, x0.shape[0], loss)
            pp.record()  # torchtitan's schedule runs the same stage objects: note them again
            actions = pp.actions
        opt = optimizer(pp.parameters())
        losses = []
        for it in range(job.iterations):
            x, y = data(it)
            got = pp.step(x, target=y)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if got is not None:
                scale = pp.bundle.microbatches if job.torchtitan else 1  # torchtitan reports what its loss_fn gave
                losses.append(float(torch.stack([g.detach() for g in got]).mean()) * scale)
        results.append((losses, {k: v.detach().clone() for k, v in pp.state_dict().items()},
                        [str(a) for a in actions or []]))
        dist.barrier()
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def _count(bundle: str) -> int:
    import json

    return int(json.loads((Path(bundle) / "pipeline.json").read_text())["microbatches"])


def run(jobs: list[Job], tmp: Path, timeout: float = 300, world: int = 2) -> list[Result]:
    """Train every job on ``world`` ranks (a 2-stage pipeline, copied over ``world / 2`` data-parallel ranks: shards
    or replicas), one after the other; the results in job order: the losses are the mean over the data-parallel
    ranks (the global batch's), the state the first pipeline's, whole."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A fork server that imported torch and this module once: each later run forks its ranks from it in a moment,
    # where spawning paid torch's imports again for every rank of every run (``stop_fork_server`` ends it).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    out = str(tmp / "torch-results")
    procs = [ctx.Process(target=_worker, args=(r, port, jobs, out, world)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
        codes = [p.exitcode for p in procs]
        if codes != [0] * world:
            raise RuntimeError(f"the torch.distributed.pipelining ranks ended with {codes} (None: still running after "
                               f"{timeout:.0f} s)")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    results = []
    for j in range(len(jobs)):
        each = [ranks[r][j][0] for r in range(world) if ranks[r][j][0]]  # the last stage of each pipeline
        losses = [sum(v) / len(v) for v in zip(*each)] if each else []
        state = {**ranks[0][j][1], **ranks[1][j][1]}
        results.append(Result(losses, state, {r: ranks[r][j][2] for r in range(world)}))
    return results


def stop_fork_server() -> None:
    """End the fork server ``run`` started (the test module that used it calls this when it is done with it)."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # what CPython's own tests call to end it
