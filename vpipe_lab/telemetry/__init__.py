"""Metrics as they stream in: per-iteration aggregation, the run log on disk and external sinks. No torch."""
