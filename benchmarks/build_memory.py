"""Memory of building the model: each stage's worker against a plain process that builds the whole model.

    python benchmarks/build_memory.py [--layers 12] [--stages 4]

A GPT-2 (hidden 768, vocab 50257: GPT-2 small's shapes, random weights) in a 4-stage pipeline on CPU. Each worker
builds only its own units' tensors (runtime/build.py); the other stages' tensors are initialised in reused scratch
memory. Peak resident memory (VmHWM) of every worker after start-up, minus a worker's baseline (the same start-up
with a 2-layer, 8-wide GPT-2: imports, process group, capture), against a 1-stage worker, which builds the whole
model through the same path, and a plain process running ``torch.manual_seed(0); model()``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import psutil

import vpipe_lab

FACTORY = """
def gpt2(layers={layers}, width={width}):
    from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops
    allow_torchvision_without_ops()
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4,
                                                                use_cache=False))
"""


def hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def plain(layers: int, build: bool) -> int:
    code = FACTORY.format(layers=layers, width=768) + (
        "import torch, transformers\n" + ("torch.manual_seed(0); m = gpt2()\n" if build else "gpt2.__code__\n")
        + "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) * 1024


def data(iteration: int):  # type: ignore[no-untyped-def]
    import torch

    ids = torch.randint(0, 50257, (8, 65), generator=torch.Generator().manual_seed(iteration))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def workers(layers: int, width: int, stages: int) -> list[tuple[int, list[str]]]:
    """Each worker's peak resident bytes after start-up, with the units it owns."""
    namespace: dict[str, object] = {}
    exec(FACTORY.format(layers=layers, width=width), namespace)
    with vpipe_lab.launch(namespace["gpt2"], data, stages=stages, microbatches=4, device="cpu",
                          timeout=300, start_timeout=600) as session:
        procs = [p for p in psutil.Process().children(recursive=True)
                 if "vpipe_lab.runtime.process" in " ".join(p.cmdline())]
        procs.sort(key=lambda p: int(p.cmdline()[p.cmdline().index("--rank") + 1]))
        return [(hwm(p.pid), [session.names[i] for i in session.plan.layers_of(rank)])
                for rank, p in enumerate(procs)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--stages", type=int, default=4)
    args = ap.parse_args()
    base, whole = plain(args.layers, False), plain(args.layers, True)
    print(f"GPT-2 {args.layers} layers x 768: a plain process's build adds {(whole - base) / 2**20:.0f} MiB")
    floor = max(m for m, _ in workers(2, 8, args.stages))
    alone = workers(args.layers, 768, 1)[0][0] - floor
    print(f"a worker's start-up without the model: {floor / 2**20:.0f} MiB; a 1-stage worker's build adds "
          f"{alone / 2**20:.0f} MiB")
    for rank, (peak, owned) in enumerate(workers(args.layers, 768, args.stages)):
        added = peak - floor
        print(f"stage {rank} of {args.stages}: build adds {added / 2**20:4.0f} MiB = {added / alone:.2f} of the "
              f"1-stage worker's; units {owned[0]} .. {owned[-1]}")


if __name__ == "__main__":
    main()
