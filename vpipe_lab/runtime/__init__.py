"""Stage workers: torch execution of the schedule IR, swap, recompute, migration, profiling."""
