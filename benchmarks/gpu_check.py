"""One short check of the CUDA path; skips cleanly (exit 0) without a GPU.

    python benchmarks/gpu_check.py [--out gpu_check.json]

With a GPU it checks, each as a named result: NCCL process groups (2 stages when there are 2 GPUs, else 1),
swap on a side CUDA stream into pinned host memory, CUDA memory counters reported per stage, parity of a pipelined
run with plain single-process training on the GPU, and how much of the swap traffic hides under compute (iteration
time with swap against keep). Record what it prints in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
        checks["backend"] = s._ready[0].get("backend")
        checks["device"] = s._ready[0].get("device")
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
    results["checks"] = checks
    results["ok"] = bool(checks["parity_ok"] and checks["swap_ok"] and checks["cuda_counters"]
                         and checks["backend"] == "nccl")
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
