"""Where a stage's activations and weights live: the byte ledger, activations kept, swapped to the host or recomputed,
and PipeDream's weight stash."""
