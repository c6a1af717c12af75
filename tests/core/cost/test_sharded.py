"""What sharding a stage does to one rank's memory and time, worked by hand (docs/cost_model.md's table)."""

from __future__ import annotations

import pytest

from vpipe_lab.core.cost.costmodel import CostModel, estimate
from vpipe_lab.core.cost.sharded import ShardCost, ShardModel
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile, SharedTensor
from vpipe_lab.core.sharding import Sharding

L = LayerCost
# Four units: 400, 800, 800 and 400 bytes of parameters (Adam: twice as much state), the first and the last tied
# through a 100-byte tensor (an embedding and its head), one second of forward and two of backward each.
TIE = SharedTensor("emb.weight", (0, 3), param_bytes=100, optimizer_bytes=200)
PROFILE = ModelProfile(tuple(
    L(f"u{i}", 1.0, 2.0, activation_bytes=1000, input_bytes=50, output_bytes=50, param_bytes=p, optimizer_bytes=2 * p)
    for i, p in enumerate((400, 800, 800, 400))), shared=(TIE,))
# 1,000 bytes/s between shards, no latency: a collective of b whole bytes over K shards takes b (K-1)/K / 1000 s
CLUSTER = Cluster(2, 10**9, swap_bandwidth=1e9, link_bandwidth=1e12, shard_bandwidth=1000.0)


def test_each_sharding_holds_and_spends_what_the_table_says() -> None:
    model = ShardModel([400, 800, 800, 400], [TIE], CLUSTER, shards=4)
    # layers 0:2: 1,200 bytes of parameters of which 100 are the tie; static 4 x 1,200 (params, grads, 2x Adam)
    static, params = 4 * 1200, 1200
    mine = (static - 400) // 4 + 400  # a quarter of the rest, the tie (100 + 100 + 200) whole
    whole, unit = 1100, 800  # P (and G) without the tie; the largest unit
    collective = whole * 3 / 4 / 1000.0
    unmade = whole // 4  # the sharded gradients, made by the iteration's one reduce under hold and regather
    expected = {
        Sharding.HOLD: ShardCost(mine, 2 * whole - unmade, 2 * whole - unmade, once_s=2 * collective),
        Sharding.REGATHER: ShardCost(mine, whole + unit - unmade, whole + unit - unmade, collective, collective,
                                     once_s=collective),
        Sharding.SCATTER: ShardCost(mine, whole + 2 * unit, whole, 0.0, collective, once_s=collective),
        Sharding.STREAM: ShardCost(mine, 2 * unit, 0, collective, 2 * collective),
    }
    for mode, cost in expected.items():
        assert model.cost(0, 2, static, params, mode, split=False) == cost, mode
    # a split backward (B, then W) leaves the chunk's gradients whole until its W is reduced
    assert model.cost(0, 2, static, params, Sharding.STREAM, split=True).whole_bytes == unit + whole
    assert model.cost(0, 2, static, params, Sharding.SCATTER, split=True).whole_bytes == 2 * whole + unit
    assert model.ties(1, 3) == (0, 0) and model.ties(0, 4) == (400, 100)


def test_a_sharded_plans_estimate_is_each_ranks() -> None:
    """1F1B, 2 stages x 4 shards, 4 micro-batches: each stage's peak is its shard plus its sharding's whole bytes on
    top of what it holds unsharded; its time adds the collectives per micro-batch and once per iteration."""
    whole_plan = Plan((0, 2, 4), ("keep",) * 4, 4, "1f1b")
    plain = estimate(whole_plan, PROFILE, CLUSTER)
    for sharding in (("hold", "stream"), ("regather", "scatter")):
        plan = whole_plan.with_mesh(shards=4, sharding=sharding)
        est = estimate(plan, PROFILE, CLUSTER)
        model = CostModel.of(plan, PROFILE, CLUSTER)
        for s, (lo, hi) in enumerate(((0, 2), (2, 4))):
            shard = model.shard_cost(s, lo, hi)
            assert shard is not None
            assert est.static_bytes[s] == shard.static_bytes < plain.static_bytes[s]
            held = plain.peak_bytes[s] - plain.static_bytes[s]  # activations, working sets, transfers
            assert est.peak_bytes[s] == shard.static_bytes + max(held + shard.whole_bytes, shard.end_bytes)
            assert est.stage_s[s] == pytest.approx(plain.stage_s[s] + shard.forward_s + shard.backward_s)
        shards = [model.shard_cost(s, lo, hi) for s, (lo, hi) in enumerate(((0, 2), (2, 4)))]
        once = max(c.once_s for c in shards if c is not None)
        assert est.iteration_s >= plain.iteration_s + once


def test_with_many_small_units_each_finer_sharding_holds_less() -> None:
    """Sixteen equal units a stage: hold keeps the stage's P + G whole, regather and scatter one of them and a unit
    or two, stream a few units; every sharded rank under the whole stage's. (With a few large units the order can
    turn: FSDP's gather holds a unit twice, so the per-unit modes pay 2 U: ``test_each_sharding_...``.)"""
    profile = ModelProfile(tuple(L(f"u{i}", 1.0, 2.0, activation_bytes=10, input_bytes=5, output_bytes=5,
                                   param_bytes=100, optimizer_bytes=200) for i in range(32)))
    base = Plan((0, 16, 32), ("keep",) * 32, 4, "1f1b")
    plain = estimate(base, profile, CLUSTER).peak_bytes
    peaks = {m: estimate(base.with_mesh(shards=4, sharding=(m, m)), profile, CLUSTER).peak_bytes for m in Sharding}
    for s in range(2):
        assert peaks[Sharding.STREAM][s] < min(peaks[Sharding.REGATHER][s], peaks[Sharding.SCATTER][s])
        assert max(peaks[Sharding.REGATHER][s], peaks[Sharding.SCATTER][s]) < peaks[Sharding.HOLD][s]
        assert peaks[Sharding.STREAM][s] < plain[s]
