import pytest

from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.profile import ModelProfile
from vpipe_lab.core.workloads import DEVICES, WORKLOADS, cluster, pressured_cluster, random_chain, workload


def test_paper_unit_counts() -> None:
    assert len(workload("bert-24")) == 49  # the paper's 49 blocks: embedding + (attention, FFN) x 24
    assert len(workload("bert-48")) == 97
    assert len(workload("transformer-6-6")) == 1 + 12 + 18 + 1
    assert len(workload("gpt-cpm-large")) == 66


def test_profiles_scale_with_microbatch_and_round_trip() -> None:
    small = workload("bert-24", microbatch_size=2)
    big = workload("bert-24", microbatch_size=8)
    assert big.layers[5].activation_bytes == 4 * small.layers[5].activation_bytes
    assert big.layers[5].forward_s == pytest.approx(4 * small.layers[5].forward_s)
    assert big.layers[5].param_bytes == small.layers[5].param_bytes
    for name in WORKLOADS:
        profile = workload(name)
        assert ModelProfile.from_json(profile.to_json()) == profile
        assert all(x.backward_s == pytest.approx(2 * x.forward_s) for x in profile.layers)


def test_bert_large_parameter_count_is_right() -> None:
    # BERT-large has ~335M parameters; fp32 params are 4 bytes each.
    params = sum(x.param_bytes for x in workload("bert-24").layers) / 4
    assert 320e6 < params < 345e6


def test_devices_and_clusters() -> None:
    c = cluster("rtx2080ti", 8)
    assert c.stages == 8 and c.shared_link and c.budgets[0] == 11 * 2**30
    assert not cluster("h200", 4).shared_link and "h200" in DEVICES
    with pytest.raises(ProfileError, match="unknown device"):
        cluster("tpu", 2)
    with pytest.raises(ProfileError, match="unknown workload"):
        workload("resnet")


def test_random_chain_is_seeded() -> None:
    assert random_chain(10, seed=3) == random_chain(10, seed=3)
    assert random_chain(10, seed=3) != random_chain(10, seed=4)
    assert pressured_cluster(random_chain(10), 2, 4, pressure=0.5).budgets[0] > 0
