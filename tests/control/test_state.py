"""The controller's view of the job: what READY reports and an attached job's current state set."""

from tests import messages
from vpipe_lab.control.state import JobState
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire.events import Current


def test_adopt_takes_rank_0s_plan_and_names_unless_the_job_says_otherwise() -> None:
    ready = [messages.ready(1), messages.ready(0, iteration=4)]
    state = JobState()
    state.adopt(ready, None)
    assert state.plan == Plan((0, 1, 2), "kk", 2) and state.names == ["a", "b"] and state.iteration == 4
    assert state.target == 4 and sorted(state.ready) == [0, 1]
    moved = Plan((0, 2, 3), "kkk", 2).to_dict()
    attached = JobState()
    attached.adopt(ready, Current(moved, 3, ["x", "y", "z"], 9, True, None))
    assert attached.plan is not None and attached.plan.boundaries == (0, 2, 3) and attached.plan_version == 3
    assert attached.iteration == 9 and attached.target is None  # running until stopped


def test_the_cluster_is_what_the_ranks_measured_with_the_job_s_budgets() -> None:
    state = JobState()
    state.ready = {1: messages.ready(1, swap_bandwidth=5e9, link_bandwidth=2e9, link_latency_s=2e-4),
                   0: messages.ready(0, swap_bandwidth=8e9, link_bandwidth=float("inf"), link_latency_s=1e-4)}
    cluster = state.cluster(2, [2**30, 2**31])
    assert cluster.memory_bytes == (2**30, 2**31) and cluster.swap_bandwidth == 5e9 and cluster.link_bandwidth == 2e9
    assert cluster.link_latency_s == 1e-4 and "2 x cpu" in cluster.name  # the slowest, a round trip halved
    assert isinstance(state.cluster(2, None).memory_bytes, int)  # no budget: the machine's memory split evenly
    # CPU ranks copy swapped activations on their compute thread: nothing hides them; GPUs' copy engines do
    assert not cluster.swap_overlaps
    state.ready = {r: messages.ready(r, device="cuda:0") for r in (0, 1)}
    assert state.cluster(2, None).swap_overlaps
