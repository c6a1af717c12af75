"""The planners: partitions (exact and balanced), vPipe's search of partition and per-layer policy, PipeDream's
all-keep partition, policies that fit a budget (per stage and per chunk), and the layer moves between two plans."""

from vpipe_lab.core.deprecated import moved
from vpipe_lab.core.planning import layer_moves as _layer_moves

moved(f"{__name__}.migration", _layer_moves)  # its name until the runtime's migrate.py made two of one
