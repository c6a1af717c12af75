"""The planners: partitions (exact and balanced), vPipe's search of partition and per-layer policy, PipeDream's
all-keep partition, policies that fit a budget (per stage and per chunk), and the layer moves between two plans."""
