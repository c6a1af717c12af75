"""Training on top of the engine: the agreed optimizer step (gradient clipping, fp16 loss scaling), tied weights
and data-parallel replicas reduced across ranks, evaluation passes. It may import ``runtime.engine`` and
``runtime.model``, torch, ``vpipe_lab.core`` and ``vpipe_lab.wire``; not the process level above (the worker, its
broker, migration and checkpoints)."""
