"""Analytic profiles of the paper's workloads, built from their shapes, and device presets to plan them on.

FLOPs per block follow the usual transformer counts (attention ``8bsh^2 + 4bs^2h``, a 4h feed-forward ``16bsh^2``,
backward twice the forward); activation bytes follow Korthikanti et al. 2022 (attention ``13sbh + 5as^2b``,
feed-forward ``21sbh`` at 16-bit, LayerNorm included), scaled to the activation width. Blocks are cut at residual
adds, as in the paper (BERT-24 has 49 units: the embedding and an attention and a feed-forward block per layer).

Time as a function of micro-batch size comes from a published measurement (``CURVES``, named on each profile's
``source``): BERT-Large's throughput at batch sizes 1, 2, 4 and 8 on one V100, sequence length 384, in NVIDIA's
DeepLearningExamples (TensorFlow/LanguageModeling/BERT/README.md, "Fine-tuning inference performance for SQuAD v1.1
on 16GB", NGC 20.06; fp32 for the fp32 devices, fp16 for mixed precision). Every bundled workload takes that
curve: their sequences (256 to 1024) are nearest its 384, and the V100's fp32 peak (15.7 TFLOPS) is the 2080 Ti's
(13.4). It is a forward-pass series, the only per-batch-size series of this model family we found published; the
backward runs the same matrix shapes (twice the work), so it gets the same efficiency. The FLOP time at the device's
fixed efficiency is the time at batch 8 and above; below, a sample costs ``throughput(8) / throughput(b)`` times
that, so planning with a global batch (``search(..., batch_size=B)``) sees larger micro-batches run faster per
sample, which is what vPipe's memory savings buy. On an H200 the small-batch penalty is surely larger than a
V100's: the curve there is a lower bound on the mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass

from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile

GIB = 1 << 30
# Published sentences/s at batch sizes (1, 2, 4, 8): BERT-Large, sequence 384, one V100 16GB, TensorFlow (NVIDIA
# DeepLearningExamples, TensorFlow/LanguageModeling/BERT/README.md, fine-tuning inference performance on 16GB).
CURVE_SIZES = (1, 2, 4, 8)
CURVES = {"fp32": (33.95, 38.47, 41.11, 41.32), "mixed": (70.74, 99.9, 128.42, 148.57)}
SOURCE = ("time vs micro-batch size: BERT-Large seq 384 on V100 ({precision}), NVIDIA DeepLearningExamples "
          "TensorFlow BERT README (NGC 20.06), scaled to FLOPs at {efficiency:.0%} of this device's peak")


def slowdown(precision: str, size: int) -> float:
    """Per-sample time at micro-batch ``size`` over that at 8 and above, from the published curve (interpolated
    between its sizes)."""
    rates = CURVES[precision]
    if size >= CURVE_SIZES[-1]:
        return 1.0
    for (a, ra), (b, rb) in zip(zip(CURVE_SIZES, rates), zip(CURVE_SIZES[1:], rates[1:])):
        if a <= size <= b:
            return rates[-1] / (ra + (rb - ra) * (size - a) / (b - a))
    return rates[-1] / rates[0]


@dataclass(frozen=True)
class Device:
    """An accelerator as the cost model sees it."""

    name: str
    memory_bytes: int
    flops: float  # peak FLOP/s at the training precision
    efficiency: float  # achieved fraction of peak on transformer blocks
    swap_bandwidth: float  # host<->device bytes/s, each direction
    link_bandwidth: float  # bytes/s between neighbouring stages
    link_latency_s: float
    shared_link: bool  # stage-to-stage traffic crosses PCIe too (no NVLink)
    precision: str  # "fp32" or "mixed"
    memory_bandwidth: float  # device memory bytes/s: what an optimizer step and a weight copy are bound by


DEVICES: dict[str, Device] = {
    # The paper's testbed: RTX 2080 Ti (11 GB, 13.4 TFLOPS fp32), PCIe 3.0 x16, no NVLink, fp32 training.
    "rtx2080ti": Device("RTX 2080 Ti, PCIe 3", 11 * GIB, 13.4e12, 0.45, 12e9, 10e9, 20e-6, True, "fp32", 616e9),
    # H200 SXM: 141 GB HBM3e, ~989 TFLOPS dense bf16, PCIe 5 x16 to the host, NVLink 4 between GPUs.
    "h200": Device("H200 SXM, NVLink", 141 * 10**9, 989e12, 0.40, 55e9, 450e9, 5e-6, False, "mixed", 4.8e12),
}


@dataclass(frozen=True)
class _Precision:
    activation: int  # bytes per activation element
    param: int  # bytes per parameter as stored for compute
    optimizer: int  # Adam state per parameter (plus fp32 master weights under mixed precision)


_PRECISIONS = {"fp32": _Precision(4, 4, 8), "mixed": _Precision(2, 2, 12)}
# Bytes an Adam step moves per parameter byte: the weights read and written, the gradient read, the state (and fp32
# master weights) read and written; over the memory bandwidth, PipeDream's per-micro-batch update on these devices.
_ADAM_TRAFFIC = {"fp32": 7, "mixed": 15}


class _Builder:
    def __init__(self, device: Device, b: int, s: int, h: int, heads: int) -> None:
        self.d, self.b, self.s, self.h, self.a = device, b, s, h, heads
        self.p = _PRECISIONS[device.precision]
        self.layers: list[LayerCost] = []

    def _time(self, flops: float) -> float:
        """At the device's efficiency: the time at micro-batch 8 and above (``slowdown`` gives smaller ones')."""
        return flops / (self.d.flops * self.d.efficiency)

    def _times(self, seconds: float) -> tuple[float, tuple[tuple[int, float, float], ...]]:
        """A layer's forward at this micro-batch size from its saturated time, and its (size, forward, backward)
        at the curve's other sizes (backward twice the forward)."""
        precision, b = self.d.precision, self.b
        points = tuple((n, seconds * n / b * slowdown(precision, n), 2 * seconds * n / b * slowdown(precision, n))
                       for n in CURVE_SIZES if n != b)
        return seconds * slowdown(precision, b), points

    def _add(self, name: str, flops: float, act_elems: float, params: int, out_mult: int = 1,
             in_bytes: int | None = None) -> None:
        sbh = self.s * self.b * self.h
        e = self.p.activation
        forward, times = self._times(self._time(flops))
        self.layers.append(LayerCost(
            name=name,
            forward_s=forward,
            backward_s=2 * forward,
            activation_bytes=int(act_elems * e / 2),  # Korthikanti's counts are in bytes at 16 bits
            input_bytes=e * sbh if in_bytes is None else in_bytes,
            output_bytes=out_mult * e * sbh,
            param_bytes=self.p.param * params,
            optimizer_bytes=self.p.optimizer * params,
            times=times,
        ))

    def embedding(self, vocab: int) -> None:
        sbh = self.s * self.b * self.h
        self._add("embedding", 2 * sbh, 4 * sbh, vocab * self.h + self.s * self.h + 2 * self.h,
                  in_bytes=8 * self.s * self.b)

    def attention(self, name: str, out_mult: int = 1, in_mult: int = 1) -> None:
        b, s, h, a = self.b, self.s, self.h, self.a
        self._add(name, 8 * b * s * h * h + 4 * b * s * s * h, 13 * s * b * h + 5 * a * s * s * b,
                  4 * h * h + 6 * h, out_mult, in_bytes=in_mult * self.p.activation * s * b * h)

    def feedforward(self, name: str, out_mult: int = 1) -> None:
        b, s, h = self.b, self.s, self.h
        self._add(name, 16 * b * s * h * h, 21 * s * b * h, 8 * h * h + 7 * h, out_mult,
                  in_bytes=out_mult * self.p.activation * s * b * h)

    def head(self, vocab: int) -> None:
        b, s, h = self.b, self.s, self.h
        # Projection to the vocabulary; the fp32 softmax of the logits dominates what it saves.
        self._add("head", 2 * b * s * h * vocab + 2 * b * s * h * h, 4 * s * b * h + 2 * 4 * s * b * vocab,
                  h * h + 3 * h + vocab)
        last = self.layers[-1]
        self.layers[-1] = LayerCost(last.name, last.forward_s, last.backward_s, last.activation_bytes,
                                    last.input_bytes, 8 * b, last.param_bytes, last.optimizer_bytes, last.times)

    def profile(self, name: str) -> ModelProfile:
        d = self.d
        return ModelProfile(tuple(self.layers), name, self.b,
                            SOURCE.format(precision="fp32" if d.precision == "fp32" else "fp16", efficiency=d.efficiency))


def bert(layers: int = 24, *, device: str = "rtx2080ti", microbatch_size: int = 4, seq: int = 512,
         hidden: int = 1024, heads: int = 16, vocab: int = 30522) -> ModelProfile:
    """BERT cut at residual adds: embedding, then attention and feed-forward blocks (2 * layers + 1 units)."""
    bld = _Builder(_device(device), microbatch_size, seq, hidden, heads)
    bld.embedding(vocab)
    for i in range(layers):
        bld.attention(f"attn{i}")
        bld.feedforward(f"ffn{i}")
    return bld.profile(f"bert-{layers}")


def transformer(encoder: int = 6, decoder: int = 6, *, device: str = "rtx2080ti", microbatch_size: int = 8,
                seq: int = 256, hidden: int = 1024, heads: int = 16, vocab: int = 33712) -> ModelProfile:
    """Encoder-decoder Transformer; decoder blocks also carry the encoder's output across stage boundaries."""
    bld = _Builder(_device(device), microbatch_size, seq, hidden, heads)
    bld.embedding(vocab)
    for i in range(encoder):
        bld.attention(f"enc{i}.attn")
        bld.feedforward(f"enc{i}.ffn")
    for i in range(decoder):
        bld.attention(f"dec{i}.self", out_mult=2, in_mult=2)
        bld.attention(f"dec{i}.cross", out_mult=2, in_mult=2)
        bld.feedforward(f"dec{i}.ffn", out_mult=2)
    bld.head(vocab)
    return bld.profile(f"transformer-{encoder}-{decoder}")


def gpt(layers: int = 32, *, device: str = "rtx2080ti", microbatch_size: int = 1, seq: int = 1024,
        hidden: int = 2560, heads: int = 32, vocab: int = 30000, name: str = "gpt-cpm-large") -> ModelProfile:
    """A decoder-only GPT (CPM-large-like by default: 32 layers, hidden 2560)."""
    bld = _Builder(_device(device), microbatch_size, seq, hidden, heads)
    bld.embedding(vocab)
    for i in range(layers):
        bld.attention(f"attn{i}")
        bld.feedforward(f"ffn{i}")
    bld.head(vocab)
    return bld.profile(name)


WORKLOADS = ("bert-24", "bert-48", "transformer-6-6", "transformer-12-12", "gpt-cpm-medium", "gpt-cpm-large")


def workload(name: str, *, device: str = "rtx2080ti", microbatch_size: int | None = None) -> ModelProfile:
    """A bundled analytic profile by name (see WORKLOADS)."""
    if name.startswith("bert-") and name in WORKLOADS:
        return bert(int(name.split("-")[1]), device=device, microbatch_size=microbatch_size or 4)
    if name.startswith("transformer-") and name in WORKLOADS:
        enc, dec = (int(x) for x in name.split("-")[1:])
        return transformer(enc, dec, device=device, microbatch_size=microbatch_size or 8)
    if name == "gpt-cpm-medium":
        return gpt(24, hidden=1024, heads=16, device=device, name=name, microbatch_size=microbatch_size or 1)
    if name == "gpt-cpm-large":
        return gpt(32, device=device, microbatch_size=microbatch_size or 1)
    raise ProfileError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)}")


def _device(name: str) -> Device:
    if name not in DEVICES:
        raise ProfileError(f"unknown device {name!r}: use one of {', '.join(DEVICES)}")
    return DEVICES[name]


def cluster(device: str, stages: int, *, memory_bytes: int | None = None) -> Cluster:
    """A pipeline of ``stages`` identical devices of the preset ``device``."""
    d = _device(device)
    return Cluster(stages, d.memory_bytes if memory_bytes is None else memory_bytes, d.swap_bandwidth,
                   d.link_bandwidth, d.link_latency_s, d.shared_link, f"{stages} x {d.name}",
                   update_s_per_byte=_ADAM_TRAFFIC[d.precision] / d.memory_bandwidth,
                   copy_s_per_byte=2 / d.memory_bandwidth)


def random_chain(layers: int, *, seed: int = 0, heterogeneity: float = 4.0, name: str = "") -> ModelProfile:
    """A seeded random chain of heterogeneous layers (times and sizes spread over ``heterogeneity``-fold ranges)."""
    import random  # local: only this helper needs it

    rng = random.Random(seed)
    out = []
    for i in range(layers):
        scale = heterogeneity ** rng.random()
        fwd = 1e-3 * scale * rng.uniform(0.5, 1.5)
        act = int(64 * 2**20 * scale * rng.uniform(0.5, 1.5))
        width = int(4 * 2**20 * heterogeneity ** rng.random())
        params = int(16 * 2**20 * heterogeneity ** rng.random())
        out.append(LayerCost(f"layer{i}", fwd, fwd * rng.uniform(1.5, 2.5), act, min(act, width), width, params,
                             2 * params))
    return ModelProfile(tuple(out), name or f"random-{layers}-{seed}")


def pressured_cluster(profile: ModelProfile, stages: int, microbatches: int, *, pressure: float = 0.6,
                      swap_bandwidth: float = 12e9, link_bandwidth: float = 10e9) -> Cluster:
    """A cluster whose per-stage budget is ``pressure`` times what an evenly split, everything-kept plan needs."""
    static = sum(x.static_bytes for x in profile.layers) / stages
    acts = sum(x.activation_bytes for x in profile.layers) / stages * min(microbatches, stages)
    return Cluster(stages, int((static + acts) * pressure), swap_bandwidth, link_bandwidth, 10e-6, True,
                   f"{stages} stages at {pressure:.0%} memory")
