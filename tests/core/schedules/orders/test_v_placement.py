"""ZBV: the V placement, its order (valid for every stage and micro-batch count), its near-zero bubble, its memory
(1F1B's first-stage peak on every stage), and its closed form against the replay."""

from __future__ import annotations

import random
import statistics

import pytest

from vpipe_lab.core.cost.costmodel import CostModel, estimate
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.errors import PlanError, ScheduleError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.layer_moves import layer_moves
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile
from vpipe_lab.core.schedules.actions import Op, Schedule, run_schedule
from vpipe_lab.core.schedules.builders import zbv_schedule
from vpipe_lab.core.schedules.orders import v_placement

UNIT = {Op.F: 1.0, Op.B: 1.0, Op.W: 1.0}


@pytest.mark.parametrize("k", range(1, 9))
def test_every_stage_and_micro_batch_count_gives_a_valid_order(k: int) -> None:
    """Fewer micro-batches than the warm-up's 2K - 1 too: each step is taken only when it exists."""
    for m in range(1, 3 * k + 2):
        schedule = zbv_schedule(k, m).validate()  # well formed, runs to the end (no deadlock)
        for r, order in enumerate(v_placement.orders(k, m)):
            mine = v_placement.chunks_of(k, r)
            assert sorted(order) == sorted((op, c, mb) for op in "FBW" for c in mine for mb in range(m))
        # the turn is local: the last stage sends nothing between its two chunks
        turn = {(Op.SEND_F, k - 1), (Op.RECV_F, k), (Op.SEND_B, k), (Op.RECV_B, k - 1)}
        assert not any((a.op, a.stage) in turn for a in schedule.stages[k - 1])


@pytest.mark.parametrize(("k", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_the_bubble_is_k_minus_1_chunk_steps(k: int, m: int) -> None:
    """The paper's unit costs (F = B = W per chunk): 6 M units of work per stage finish in 6 M + K - 1, against
    1F1B's (M + K - 1) 6 on the same stages; and what a stage holds peaks at 1F1B's first stage's (2 K
    chunk-forwards, K micro-batches of a stage) on every stage once M >= 2 K - 1."""
    t = run_schedule(zbv_schedule(k, m), lambda a: UNIT.get(a.op, 0.0))
    assert t.iteration_s == 6 * m + k - 1
    for r in range(k):
        assert max(h[0] + h[1] for h in v_placement.held(k, m, r)) == 2 * k


def test_the_placement_is_a_v_and_stage_0_computes_the_loss() -> None:
    plan = Plan((0, 1, 3, 4, 6, 7, 8, 9, 10), "kksrkkrkks", 4, "zbv", 2).validate(10, 4)
    assert plan.placement == (0, 1, 2, 3, 3, 2, 1, 0) and plan.loss_stage == 0
    assert plan.chunks_of(0) == (0, 7) and plan.chunks_of(3) == (3, 4)
    assert list(plan.layers_of(3)) == [4, 5, 6] and plan.stage_of(9) == 0
    assert Plan.from_json(plan.to_json()) == plan
    assert "[9:10]S@0" in plan.describe() and "[4:6]KK@3" in plan.describe()
    with pytest.raises(PlanError, match="zbv runs 2 chunks per stage, not virtual_stages=3"):
        Plan((0, 1, 2, 3, 4, 5, 6), "kkkkkk", 4, "zbv", 3).validate()
    # from 1F1B's plan: the second half of the layers comes back up the stages
    v = Plan((0, 3, 5, 8, 10), "k" * 10, 2, "zbv", 2)
    moves = layer_moves((0, 5, 10), v.boundaries, 2, ((0, 1), v.placement))
    assert [(m.layer, m.src, m.dst) for m in moves] == [(3, 0, 1), (4, 0, 1), (8, 1, 0), (9, 1, 0)]


@pytest.mark.parametrize("k", range(1, 9))
def test_the_plan_and_the_order_agree_on_the_v(k: int) -> None:
    plan = Plan(tuple(range(2 * k + 1)), ("keep",) * (2 * k), 2 * k, "zbv", 2)
    assert all(plan.chunks_of(r) == v_placement.chunks_of(k, r) for r in range(k)) and plan.loss_stage == 0


def test_a_schedule_with_a_local_hand_off_still_checks_its_order() -> None:
    good = zbv_schedule(2, 2)
    rows = [list(row) for row in good.stages]
    f2 = next(i for i, a in enumerate(rows[1]) if a.op is Op.F and a.stage == 2)
    f1 = next(i for i, a in enumerate(rows[1]) if a.op is Op.F and a.stage == 1)
    rows[1][f1], rows[1][f2] = rows[1][f2], rows[1][f1]  # chunk 2's forward before chunk 1's, on the same stage
    with pytest.raises(ScheduleError, match="the chunk before it runs here"):
        Schedule(rows, 2, "zbv", good.placement).validate()


def _profile(rng: random.Random, n: int) -> ModelProfile:
    layers = []
    for i in range(n):
        f = rng.uniform(0.5e-3, 1.5e-3)
        b = 2 * f * rng.uniform(0.8, 1.2)
        layers.append(LayerCost(f"l{i}", f, b, 1 << 20, 1 << 16, 1 << 16, 1 << 20,
                                weight_grad_s=b * rng.uniform(0.2, 0.6)))
    return ModelProfile(tuple(layers))


def test_the_closed_form_follows_the_replay() -> None:
    """The cost model's ZBV iteration (``chunks_iteration_s``) against the simulator's replay of the same plan, on
    random layers and latencies: median within 3%, every case within 15%."""
    rng = random.Random(4)
    errors = []
    for _ in range(40):
        k = rng.choice([2, 3, 4])
        m = rng.choice([2 * k - 1, 2 * k, 8, 16])
        profile = _profile(rng, 4 * k)
        cluster = Cluster(k, 1 << 34, 1e10, 1e12, link_latency_s=rng.choice([0.0, 1e-4, 3e-4]))
        plan = Plan(tuple(range(0, 4 * k + 1, 2)), ("keep",) * (4 * k), m, "zbv", 2)
        predicted = estimate(plan, profile, cluster).iteration_s
        errors.append(predicted / simulate(plan, profile, cluster).iteration_s - 1)
    assert abs(statistics.median(errors)) < 0.03 and max(abs(e) for e in errors) < 0.15


def test_memory_weighs_both_chunks_along_the_order() -> None:
    """Stage 0 holds its down chunk's forwards long before its up chunk's: a plan that puts the large activations in
    the up chunk peaks lower there than the count of chunk-forwards times the largest chunk would say."""
    small = LayerCost("s", 1e-3, 2e-3, 1 << 10, 1 << 8, 1 << 8, 0)
    large = LayerCost("l", 1e-3, 2e-3, 1 << 20, 1 << 8, 1 << 8, 0)
    profile = ModelProfile((small, small, small, large))  # chunk 3 (stage 0's up chunk) is the large one
    cm = CostModel(profile, Cluster(2, 1 << 34, 1e10, 1e12), 8, "zbv", 2)
    est = cm.estimate(Plan((0, 1, 2, 3, 4), "kkkk", 8, "zbv", 2))
    up = max(h[1] for h in v_placement.held(2, 8, 0))
    assert est.activation_bytes[0] < (up + 1) * (1 << 20) < 2 * 2 * (1 << 20)  # not 2K chunk-forwards of the large
    assert est.activation_bytes[0] >= up * (1 << 20)
