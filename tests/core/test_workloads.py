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
    # the published curve: a sample at micro-batch 2 costs 41.32 / 38.47 of one at 8 (BERT-Large, V100, fp32)
    assert small.layers[5].forward_s / 2 == pytest.approx(big.layers[5].forward_s / 8 * 41.32 / 38.47)
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


def test_every_workload_carries_its_published_curve_and_says_where_it_is_from() -> None:
    """Each layer has times at micro-batch sizes 1, 2, 4 and 8 whose per-sample cost falls as the published
    throughput rises, the profile names the source, and rescaling to any size reads the same curve."""
    from vpipe_lab.core.cost import scaling
    from vpipe_lab.core.workloads import CURVES, slowdown

    for name in WORKLOADS:
        for device in DEVICES:
            profile = workload(name, device=device)
            assert "DeepLearningExamples" in profile.source and "V100" in profile.source
            rates = CURVES["fp32" if DEVICES[device].precision == "fp32" else "mixed"]
            layer = profile.layers[1]
            per_sample = {b: f / b for b, f, _ in layer.times} | {profile.microbatch_size: layer.forward_s /
                                                                  profile.microbatch_size}
            assert sorted(per_sample) == [1, 2, 4, 8]
            for (a, ra), (b, rb) in zip(zip((1, 2, 4, 8), rates), zip((2, 4, 8), rates[1:])):
                assert per_sample[a] / per_sample[b] == pytest.approx(rb / ra)
            at16 = scaling.at(profile, 16)
            assert at16.source == profile.source
            assert at16.layers[1].forward_s / 16 == pytest.approx(per_sample[8])  # no gain beyond what was measured
    assert slowdown("fp32", 3) == pytest.approx(41.32 / ((38.47 + 41.11) / 2))
