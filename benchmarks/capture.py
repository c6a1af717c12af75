"""What bringing a model costs at start-up: capture (torch.export + cutting) per model, and launch-to-ready.

    python benchmarks/capture.py

Capture times are in-process, median of 3, for the test suite's tiny configurations (random weights); the units
each model is cut into are printed with them. Launch-to-ready is 2 CPU workers: imports, meta-device layout, the
stage's own build, capture, process group, bandwidth probe.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vpipe_lab
from tests.integration import zoo
from tests.runtime.model.test_capture import hf
from vpipe_lab.runtime.model.batches import split
from vpipe_lab.runtime.model.capture import capture


def main() -> None:
    ids = torch.randint(0, 97, (2, 16))
    cases = {
        "GPT-2 (4 layers, 32 wide)": (zoo.gpt2, split(zoo.gpt2_data(0)[0], 4, "inputs")[0]),
        "BERT (3 layers)": (lambda: hf("bert"), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
        "Llama (3 layers)": (lambda: hf("llama"), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
        "ResNet-18": (zoo.resnet18, split(zoo.image_data(0)[0], 4, "inputs")[0]),
    }
    print("| model | units | capture (s) |\n|---|---|---|")
    for label, (factory, example) in cases.items():
        times, chain = [], None
        for _ in range(3):
            model = factory().train()
            start = time.perf_counter()
            chain = capture(model, example)
            times.append(time.perf_counter() - start)
        assert chain is not None
        print(f"| {label} | {len(chain)}: {chain.names[0]} … {chain.names[-1]} | {statistics.median(times):.2f} |")
    print("\n| launch to ready, 2 CPU stages | s |\n|---|---|")
    for label, args in (("bundled mlp (nn.Sequential, no capture)", ("mlp",)),
                        ("GPT-2 (transformers import, meta layout, own build, capture)", (zoo.gpt2, zoo.gpt2_data))):
        start = time.perf_counter()
        with vpipe_lab.launch(*args, stages=2, microbatches=4, device="cpu", timeout=120, start_timeout=300):
            ready = time.perf_counter() - start
        print(f"| {label} | {ready:.1f} |")


if __name__ == "__main__":
    main()
