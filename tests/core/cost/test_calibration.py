"""The what-if made relative (core/cost/calibration.py): a simulation scaled by how the running plan's recent measured
iterations compare with its own simulation; robust to one noisy iteration, refused when it cannot be trusted."""

from __future__ import annotations

import statistics

import pytest

from vpipe_lab.core.cost.calibration import BOUNDS, MIN_SAMPLES, RECENT, RUN, WINDOW_S, calibrate, steady, window


def test_scales_a_draft_by_the_running_plans_measured_against_simulated() -> None:
    found = calibrate([0.056, 0.057, 0.055, 0.056, 0.058], 0.0583)
    assert found is not None and found.measured_s == 0.056 and found.samples == 5
    assert found.factor == pytest.approx(0.056 / 0.0583)
    assert found.apply(0.0663) == pytest.approx(0.0663 * 0.056 / 0.0583)
    assert found.apply(0.0583) == pytest.approx(0.056)  # the running plan predicts what it measures
    assert "x0.961" in found.describe() and "56.00 ms" in found.describe() and "newest 5" in found.describe()


def test_one_noisy_iteration_moves_nothing() -> None:
    steady = [0.05] * 9
    assert calibrate([*steady, 0.05], 0.05).factor == calibrate([*steady, 0.9], 0.05).factor == 1.0  # type: ignore[union-attr]


def test_no_calibration_from_too_few_samples_an_empty_simulation_or_a_profile_that_no_longer_fits() -> None:
    assert calibrate([0.05] * (MIN_SAMPLES - 1), 0.05) is None
    assert calibrate([0.05, 0.0, -1.0, 0.05, 0.05, 0.05], 0.05) is None  # non-positive times are not samples
    assert calibrate([0.05] * 10, 0.0) is None
    assert calibrate([0.05] * 10, 0.05 / (BOUNDS[1] * 1.01)) is None
    assert calibrate([0.05] * 10, 0.05 / (BOUNDS[0] * 0.99)) is None
    assert calibrate([0.05] * 10, 0.05 / BOUNDS[1]) is not None


def test_the_window_is_seconds_for_fast_iterations_and_iterations_for_slow_ones() -> None:
    assert window([]) == []
    fast = [(0.05 * i, 0.05) for i in range(2000)]  # 100 s of 50 ms iterations: those of the last WINDOW_S seconds
    assert len(window(fast)) == int(WINDOW_S / 0.05) + 1
    slow = [(5.0 * i, 5.0) for i in range(100)]  # 5 s iterations: the newest RECENT, though they span minutes
    assert window(slow) == [5.0] * RECENT
    # A transient of 3 s in the last 20 (the drag drawing, say) is a minority: the median is the steady time.
    steady = [(0.05 * i, 0.06 if 0.05 * i > 97 else 0.05) for i in range(2000)]
    found = calibrate(window(steady), 0.05)
    assert found is not None and found.factor == 1.0


def test_the_steady_pace_sees_through_a_transient_that_slowed_a_stretch_of_iterations() -> None:
    quiet = [0.048, 0.049, 0.050, 0.051, 0.052] * (RUN // 5)  # one run: median 50 ms
    assert steady(quiet * 10) == pytest.approx(0.050)
    # A page loading beside the job: 40% of the window 60-110% slower, then quiet again. The median of all moves up
    # (to the quiet runs' slowest, 52 ms); the steady pace stays at the quiet one.
    loaded = quiet * 3 + [t * 1.6 for t in quiet] * 3 + [t * 2.1 for t in quiet] + quiet * 3
    assert steady(loaded) == pytest.approx(0.050) and statistics.median(loaded) == pytest.approx(0.052)
    found = calibrate(loaded, 0.05)
    assert found is not None and found.factor == pytest.approx(1.0)
    # So is a slow stretch at the newest end (the drag drawing while the preview is computed).
    assert steady(quiet * 7 + [t * 1.5 for t in quiet] * 3) == pytest.approx(0.050)
    # A machine that became slower for good (most of the window) is followed.
    assert steady(quiet * 2 + [t * 1.3 for t in quiet] * 8) == pytest.approx(0.065)
    assert steady([0.05, 0.06, 0.07]) == 0.06  # fewer than four runs: the median of all


def test_on_a_steady_machine_the_pace_is_the_plain_median_not_its_fast_end() -> None:
    # Runs whose medians spread over +-6% (a machine that is noisy but not disturbed): every run is a quiet one.
    runs = [[0.050 * f] * RUN for f in (0.94, 0.97, 1.0, 1.0, 1.03, 1.06, 0.99, 1.01)]
    times = [t for run in runs for t in run]
    assert steady(times) == pytest.approx(statistics.median(times))
