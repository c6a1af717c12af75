"""One short check of the CUDA path; skips cleanly (exit 0) without a GPU.

    python benchmarks/gpu_check.py [--out gpu_check.json]

With a GPU it checks, each as a named result: NCCL process groups (2 stages when there are 2 GPUs, else 1),
swap on a side CUDA stream into pinned host memory, CUDA memory counters reported per stage, parity of a pipelined
run with plain single-process training on the GPU, a single-stage GPU run against plain training on the CPU (the
numerics match across devices), how much of the swap traffic hides under compute (iteration time with swap against
keep), measured from CUDA events what fraction of a swapped layer's copies ran while its neighbours computed, and
that weight gradients accumulated inside the GEMM (runtime/engine/wgrad.py) equal autograd's, with both backwards' times,
and parity of ZB-H1 and (with 2 GPUs) interleaved 1F1B and ZBV with plain training on the GPU; that a model laid out
on the meta device is captured with the CUDA branch of device-dependent code (transformers' MoE layers count tokens
with an integer histc on CUDA), a Mixtral trains on the GPU equal to plain training there with its experts' load
counted, and the allocator's peak (max_memory_allocated) is reported beside the cost model's prediction.
Record what it prints in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def swap_overlap(torch) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Swap out a layer's saved activations while the next layers compute, and measure from events on the copy
    stream and the compute stream how much of the copy ran concurrently with compute."""
    from vpipe_lab.runtime.memory.ledger import Ledger
    from vpipe_lab.runtime.memory.swap import SwapEngine

    device = torch.device("cuda", 0)
    engine = SwapEngine(device, Ledger())
    layer = torch.nn.Linear(4096, 4096).to(device)
    neighbours = [torch.nn.Linear(4096, 4096).to(device) for _ in range(8)]
    x = torch.randn(8192, 4096, device=device, requires_grad=True)
    with engine.recording(0, 0):
        y = layer(x)  # saves x: 128 MiB
    timed = lambda: torch.cuda.Event(enable_timing=True)
    ref, c0, c1, s0, s1 = timed(), timed(), timed(), timed(), timed()
    torch.cuda.synchronize(device)
    ref.record()
    assert engine.stream is not None
    s0.record(engine.stream)
    moved = engine.swap_out(0, 0)
    s1.record(engine.stream)
    c0.record()
    h = y.detach()
    with torch.no_grad():
        for n in neighbours:
            h = n(h)
    c1.record()
    torch.cuda.synchronize(device)
    a, b = ref.elapsed_time(s0), ref.elapsed_time(s1)
    c, d = ref.elapsed_time(c0), ref.elapsed_time(c1)
    overlap = max(0.0, min(b, d) - max(a, c))
    fraction = overlap / (b - a) if b > a else 0.0
    return {"swap_copy_ms": round(b - a, 3), "neighbour_compute_ms": round(d - c, 3), "swapped_bytes": moved,
            "swap_overlap_fraction": round(fraction, 3), "swap_overlap_ok": fraction >= 0.5}


def fused_wgrad(torch) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Weight gradients accumulated inside the GEMM on the GPU: the same gradients as autograd's accumulation over
    8 micro-batches, and the backward time of both (CUDA events)."""
    import copy

    from vpipe_lab.runtime.engine import wgrad

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096)).to(device)
    fused = copy.deepcopy(plain)
    wgrad.fuse(fused)
    xs = [torch.randn(16, 4096, device=device) for _ in range(8)]

    def run(model) -> float:  # type: ignore[no-untyped-def]
        model.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for x in xs:
            model(x).square().mean().backward()
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end))

    for _ in range(3):  # warm-up, then the median of 5 alternated runs
        run(plain), run(fused)
    times = [(run(plain), run(fused)) for _ in range(5)]
    diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(plain.parameters(), fused.parameters()))
    t_plain = sorted(t for t, _ in times)[2]
    t_fused = sorted(t for _, t in times)[2]
    return {"fused_wgrad_max_abs_diff": diff, "fused_wgrad_ok": diff < 1e-4, "fused_wgrad_ms": round(t_fused, 3),
            "autograd_wgrad_ms": round(t_plain, 3), "fused_wgrad_speedup": round(t_plain / t_fused, 3)}


def moe_on_cuda(torch, stages: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The CUDA branch of device-dependent code in the capture, and a Mixtral pipelined on the GPU."""
    import vpipe_lab
    from tests.models.zoo import lm_data, mixtral, sgd
    from tests.runtime import reference
    from tests.runtime.model.test_run_device import DeviceBranch, _branch
    from vpipe_lab.core.cost.costmodel import estimate
    from vpipe_lab.runtime.build import on_meta
    from vpipe_lab.runtime.engine.executor import default_loss
    from vpipe_lab.runtime.model.capture import capture

    meta, _ = on_meta(DeviceBranch, 0)
    chain = capture(meta.train(), torch.zeros(2, 4, device="meta"), split=["proj", "head"],
                    device=torch.device("cuda", 0))
    dtype, scale = _branch(n for u in chain.units for n in u.graph.graph.nodes)
    out: dict[str, object] = {"capture_cuda_branch_ok": dtype == torch.int32 and scale == 3.0}
    with vpipe_lab.launch(mixtral, lm_data, stages=stages, microbatches=4, optimizer=sgd, device="cuda",
                          timeout=300) as s:
        s.run(4)
        s.wait(timeout=600)
        state, experts = s.state_dict(), s.metrics.experts
        memory = s.metrics.memory
        last = memory[memory["iteration"] == memory["iteration"].max()].sort_values("stage")
        predicted = estimate(s.plan, s.profile(), s.cluster()).peak_bytes
    torch.manual_seed(0)
    model = mixtral().cuda()
    on_gpu = lambda it: tuple({k: v.cuda() for k, v in x.items()} if isinstance(x, dict) else x.cuda()
                              for x in lm_data(it))
    model, _ = reference.train(None, on_gpu, default_loss, sgd, iterations=4, microbatches=4, model=model)
    worst = max(float((state[k].cuda().float() - v.float()).abs().max()) for k, v in model.state_dict().items())
    out.update({"moe_max_abs_diff": worst, "moe_ok": worst < 1e-3 and not experts.empty,
                "moe_expert_rows": len(experts),
                "moe_peak_measured": [int(v) for v in last["allocated_peak"]],
                "moe_peak_predicted": list(predicted)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    import torch

    results: dict[str, object] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        results["skipped"] = "no CUDA device: nothing to check"
        print(json.dumps(results, indent=1))
        return 0
    import vpipe_lab
    from tests.runtime import reference
    from vpipe_lab import Plan
    from vpipe_lab.examples import gpt

    gpus = torch.cuda.device_count()
    results["gpus"] = gpus
    results["device_name"] = torch.cuda.get_device_name(0)
    stages = 2 if gpus >= 2 else 1
    n = 8
    bounds = (0, 4, 8) if stages == 2 else (0, 8)
    checks: dict[str, object] = {}

    def session(policies: str, iterations: int):  # type: ignore[no-untyped-def]
        plan = Plan(bounds, tuple(policies), 4, "gpipe")
        s = vpipe_lab.launch("gpt-tiny", stages=stages, microbatches=4, schedule="gpipe", plan=plan, device="cuda",
                             timeout=120)
        s.run(iterations)
        s.wait(timeout=600)
        return s

    # 1. NCCL, CUDA memory counters, parity with plain training on the GPU.
    t0 = time.perf_counter()
    with session("k" * n, 3) as s:
        checks["backend"] = s.processes.started(0).get("backend")
        checks["device"] = s.processes.started(0).get("device")
        mem = s.metrics.memory
        checks["cuda_counters"] = bool("cuda_peak" in mem and (mem["cuda_peak"] > 0).all())
        state = s.state_dict()
    checks["startup_and_3_iterations_s"] = round(time.perf_counter() - t0, 1)
    torch.manual_seed(0)
    model = gpt.model().cuda()
    model, _ = reference.train(gpt.model, lambda it: tuple(t.cuda() for t in gpt.data(it)), gpt.loss, gpt.optimizer,
                               iterations=3, microbatches=4, model=model)
    worst = max(float((state[k].cuda().float() - v.float()).abs().max()) for k, v in model.state_dict().items())
    checks["parity_max_abs_diff"] = worst
    checks["parity_ok"] = worst < 1e-3  # GPU kernels differ in accumulation order; CPU parity is exact

    # 2. Swap on the side stream into pinned memory, and how much of it hides under compute.
    with session("k" * n, 12) as keep:
        t_keep = float(keep.metrics.iterations["time_s"].iloc[2:].median())
    with session("kssssssk", 12) as swap:
        frame = swap.metrics.iterations
        t_swap = float(frame["time_s"].iloc[2:].median())
        mem = swap.metrics.memory
        checks["swapped_to_host_bytes"] = int(mem["host"].max())
        tl = swap.metrics.timeline(1)
        copies = sum(sp.duration_s for sp in tl if sp.kind in ("swap_out", "swap_in"))
    checks["iteration_keep_ms"] = round(1e3 * t_keep, 2)
    checks["iteration_swap_ms"] = round(1e3 * t_swap, 2)
    checks["swap_slowdown"] = round(t_swap / t_keep - 1, 4)
    checks["swap_issue_time_ms"] = round(1e3 * copies, 2)
    checks["swap_ok"] = checks["swapped_to_host_bytes"] > 0  # type: ignore[operator]
    # 3. One stage on the GPU against plain training on the CPU.
    plan = Plan((0, n), ("keep",) * n, 4, "1f1b")
    with vpipe_lab.launch("gpt-tiny", stages=1, microbatches=4, plan=plan, device="cuda", timeout=120) as one:
        one.run(3)
        one.wait(timeout=300)
        gpu_state = one.state_dict()
    cpu_model, _ = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=3, microbatches=4)
    drift = max(float((gpu_state[k].cpu().float() - v.float()).abs().max()) for k, v in cpu_model.state_dict().items())
    checks["single_stage_gpu_vs_cpu_max_abs_diff"] = drift
    checks["single_stage_gpu_vs_cpu_ok"] = drift < 1e-3
    # 4. Copies of a swapped layer overlap its neighbours' compute (CUDA events on both streams).
    checks.update(swap_overlap(torch))
    # 5. Fused weight-gradient accumulation on the GPU: same gradients, and its speed against autograd's.
    checks.update(fused_wgrad(torch))
    # 6. The newer schedules on the GPU: ZB-H1 (its weight steps run deferred GEMMs from autograd's device thread)
    # and, with 2 GPUs, interleaved 1F1B and ZBV on two chunks per stage (ZBV: stage 0 holds the first and the last
    # chunk, its W steps deferred per chunk); each against plain training on the GPU.
    newer = ("zb-h1", "interleaved-1f1b", "zbv")
    for schedule, virtual in (("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2)):
        if virtual > stages:
            checks[f"{schedule}_ok"] = "skipped: two chunks per stage need 2 stages (2 GPUs)"
            continue
        cut = tuple(range(0, n + 1, n // (stages * virtual)))
        plan = Plan(cut, tuple("krsk" * (n // 4)), 4, schedule, virtual)
        with vpipe_lab.launch("gpt-tiny", stages=stages, microbatches=4, schedule=schedule, plan=plan,
                              virtual_stages=virtual, device="cuda", timeout=120) as run:
            run.run(3)
            run.wait(timeout=300)
            ran = run.state_dict()
            kinds = {sp.kind for sp in run.metrics.timeline(1)}
        worst = max(float((ran[k].cuda().float() - v.float()).abs().max()) for k, v in model.state_dict().items())
        checks[f"{schedule}_max_abs_diff"] = worst
        checks[f"{schedule}_ok"] = worst < 1e-3 and (schedule == "interleaved-1f1b" or "wgrad" in kinds)
    checks.update(moe_on_cuda(torch, stages))
    results["checks"] = checks
    results["ok"] = bool(checks["parity_ok"] and checks["swap_ok"] and checks["cuda_counters"]
                         and checks["capture_cuda_branch_ok"] and checks["moe_ok"]
                         and checks["backend"] == "nccl" and checks["single_stage_gpu_vs_cpu_ok"]
                         and checks["swap_overlap_ok"] and checks["fused_wgrad_ok"]
                         and all(checks[f"{s}_ok"] is not False for s in newer))
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
