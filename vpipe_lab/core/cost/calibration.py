"""The what-if made relative: a plan's simulated iteration scaled by how the running plan's measured iterations compare
with its own simulation under the same profile.

The simulator replays a plan from per-layer times measured by a profile. Those times carry whatever the machine was
doing while they were measured (another process on the cores, a browser drawing the dashboard) and leave out what no
layer owns (the optimizer step's Python, the control loop); both bias every plan's simulation alike. The running plan
is measured all the time, so the ratio of its recent steady pace (``steady``) to its simulation, applied to a draft's
simulation, cancels that shared bias and follows the machine as it is now. Medians throughout, so one noisy
iteration moves nothing. ``benchmarks/what_if_browser.py`` (a drag in JupyterLab, five schedules) measures it: see
benchmarks/RESULTS.md, "The what-if priced when the user drags".
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_SAMPLES = 5  # fewer recent iterations than this: no calibration (the plain simulation is shown)
RECENT = 50  # at least the running plan's newest this many iterations give its pace (slow iterations) ...
WINDOW_S = 20.0  # ... and all that ended within this many seconds of the newest (fast ones: a transient is a minority)
MOST = 2000  # ... at most this many
SETTLE = 2  # iterations after a plan came into force left out (the migration's own and the first after it)
BOUNDS = (0.5, 2.0)  # a ratio outside is not a bias to correct but a profile that no longer fits (re-profile)
RUN = 10  # consecutive iterations whose median is one reading of the machine's pace (see steady)
QUIET = 0.15  # readings within this of the lower quartile's are the quiet ones, whose median is the steady pace


@dataclass(frozen=True)
class Calibration:
    """The running plan's recent steady pace (``steady``) against its simulated iteration under the profile in
    hand."""

    measured_s: float
    simulated_s: float
    samples: int

    @property
    def factor(self) -> float:
        return self.measured_s / self.simulated_s

    def apply(self, simulated_s: float) -> float:
        """A plan's simulated iteration, calibrated."""
        return simulated_s * self.factor

    def describe(self) -> str:
        return (f"x{self.factor:.3f}: the running plan measured {self.measured_s * 1e3:.2f} ms (its steady pace over "
                f"its newest {self.samples} iterations) where it simulates {self.simulated_s * 1e3:.2f} ms")


def window(recent: Sequence[tuple[float, float]]) -> list[float]:
    """The iteration times that give the running plan's pace (``steady``), from its newest iterations as (end,
    seconds) pairs, oldest first: those that ended within ``WINDOW_S`` of the newest, or the newest ``RECENT`` when
    fewer did (all of them when the records carry no end times). A window in seconds, so a transient of a few seconds
    (a page loading, the drag itself drawing) is a minority of it however fast the iterations are; in iterations at
    least, so slow ones still give many readings."""
    if not recent:
        return []
    newest = recent[-1][0]
    inside = [seconds for end, seconds in recent if end >= newest - WINDOW_S]
    return inside if len(inside) >= RECENT else [seconds for _, seconds in recent[-RECENT:]]


def steady(times: Sequence[float]) -> float:
    """The pace the machine keeps in ``times`` (seconds, oldest first): the median of the quiet readings, where a
    reading is the median of a run of ``RUN`` consecutive iterations (counted back from the newest) and the quiet
    ones are those within ``QUIET`` of the readings' lower quartile; the median of all with fewer than four runs.
    Load only ever slows an iteration and a transient slows a stretch of them (a page loading beside the job, the
    drag itself drawing): its readings stand above the rest and are left out, while on a steady machine every
    reading is quiet and this is the plain median. A slowdown that lasts most of the window is the quartile itself,
    so it is followed."""
    runs = [times[max(0, end - RUN):end] for end in range(len(times), RUN - 1, -RUN)]
    if len(runs) < 4:
        return statistics.median(times)
    readings = sorted(statistics.median(run) for run in runs)
    base = readings[(len(readings) - 1) // 4]
    return statistics.median([r for r in readings if r <= base * (1 + QUIET)])


def calibrate(recent_s: Sequence[float], simulated_s: float, *, min_samples: int = MIN_SAMPLES) -> Calibration | None:
    """From the running plan's recent iteration times (seconds, oldest first) and its simulated iteration; None when
    there are too few samples, the simulation is empty, or the ratio is outside ``BOUNDS`` (a stale profile)."""
    times = [t for t in recent_s if t > 0]
    if len(times) < min_samples or simulated_s <= 0:
        return None
    found = Calibration(steady(times), simulated_s, len(times))
    return found if BOUNDS[0] <= found.factor <= BOUNDS[1] else None
