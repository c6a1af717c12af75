"""The engine: one stage's units executed per the schedule IR, with keep / swap / recompute per unit, fused weight
gradients, measured memory, the online profiler's measurements and the point-to-point transfers between stages. It
may import ``runtime.model`` (what it runs), torch, ``vpipe_lab.core`` and ``vpipe_lab.wire``; not
``runtime.training`` or the process level above."""
