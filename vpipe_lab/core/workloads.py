"""Analytic profiles of the paper's workloads, built from their shapes, and device presets to plan them on.

FLOPs per block follow the usual transformer counts (attention ``8bsh^2 + 4bs^2h``, a 4h feed-forward ``16bsh^2``,
backward twice the forward); activation bytes follow Korthikanti et al. 2022 (attention ``13sbh + 5as^2b``,
feed-forward ``21sbh`` at 16-bit, LayerNorm included), scaled to the activation width. Blocks are cut at residual
adds, as in the paper (BERT-24 has 49 units: the embedding and an attention and a feed-forward block per layer).

Time as a function of micro-batch size: these profiles have no efficiency curve. Their times come from FLOPs at a
fixed fraction of the device's peak, so they are linear in the micro-batch size (each layer's ``times`` is empty), and
planning them with a global batch (``search(..., batch_size=B)``) sees no gain from larger micro-batches except what
memory and the pipeline bubble give. We found no published per-micro-batch-size measurement of these models on
these devices to take a curve from, and a made-up one would decide the comparison; measured profiles
(``Session.profile()``) carry real curves.
"""

from __future__ import annotations

from dataclasses import dataclass

from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile

GIB = 1 << 30


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


DEVICES: dict[str, Device] = {
    # The paper's testbed: RTX 2080 Ti (11 GB, 13.4 TFLOPS fp32), PCIe 3.0 x16, no NVLink, fp32 training.
    "rtx2080ti": Device("RTX 2080 Ti, PCIe 3", 11 * GIB, 13.4e12, 0.45, 12e9, 10e9, 20e-6, True, "fp32"),
    # H200 SXM: 141 GB HBM3e, ~989 TFLOPS dense bf16, PCIe 5 x16 to the host, NVLink 4 between GPUs.
    "h200": Device("H200 SXM, NVLink", 141 * 10**9, 989e12, 0.40, 55e9, 450e9, 5e-6, False, "mixed"),
}


@dataclass(frozen=True)
class _Precision:
    activation: int  # bytes per activation element
    param: int  # bytes per parameter as stored for compute
    optimizer: int  # Adam state per parameter (plus fp32 master weights under mixed precision)


_PRECISIONS = {"fp32": _Precision(4, 4, 8), "mixed": _Precision(2, 2, 12)}


class _Builder:
    def __init__(self, device: Device, b: int, s: int, h: int, heads: int) -> None:
        self.d, self.b, self.s, self.h, self.a = device, b, s, h, heads
        self.p = _PRECISIONS[device.precision]
        self.layers: list[LayerCost] = []

    def _time(self, flops: float) -> float:
        return flops / (self.d.flops * self.d.efficiency)

    def _add(self, name: str, flops: float, act_elems: float, params: int, out_mult: int = 1,
             in_bytes: int | None = None) -> None:
        sbh = self.s * self.b * self.h
        e = self.p.activation
        self.layers.append(LayerCost(
            name=name,
            forward_s=self._time(flops),
            backward_s=2 * self._time(flops),
            activation_bytes=int(act_elems * e / 2),  # Korthikanti's counts are in bytes at 16 bits
            input_bytes=e * sbh if in_bytes is None else in_bytes,
            output_bytes=out_mult * e * sbh,
            param_bytes=self.p.param * params,
            optimizer_bytes=self.p.optimizer * params,
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
                                    last.input_bytes, 8 * b, last.param_bytes, last.optimizer_bytes)


def bert(layers: int = 24, *, device: str = "rtx2080ti", microbatch_size: int = 4, seq: int = 512,
         hidden: int = 1024, heads: int = 16, vocab: int = 30522) -> ModelProfile:
    """BERT cut at residual adds: embedding, then attention and feed-forward blocks (2 * layers + 1 units)."""
    bld = _Builder(_device(device), microbatch_size, seq, hidden, heads)
    bld.embedding(vocab)
    for i in range(layers):
        bld.attention(f"attn{i}")
        bld.feedforward(f"ffn{i}")
    return ModelProfile(tuple(bld.layers), f"bert-{layers}", microbatch_size)


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
    return ModelProfile(tuple(bld.layers), f"transformer-{encoder}-{decoder}", microbatch_size)


def gpt(layers: int = 32, *, device: str = "rtx2080ti", microbatch_size: int = 1, seq: int = 1024,
        hidden: int = 2560, heads: int = 32, vocab: int = 30000, name: str = "gpt-cpm-large") -> ModelProfile:
    """A decoder-only GPT (CPM-large-like by default: 32 layers, hidden 2560)."""
    bld = _Builder(_device(device), microbatch_size, seq, hidden, heads)
    bld.embedding(vocab)
    for i in range(layers):
        bld.attention(f"attn{i}")
        bld.feedforward(f"ffn{i}")
    bld.head(vocab)
    return ModelProfile(tuple(bld.layers), name, microbatch_size)


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
                   d.link_bandwidth, d.link_latency_s, d.shared_link, f"{stages} x {d.name}")


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
