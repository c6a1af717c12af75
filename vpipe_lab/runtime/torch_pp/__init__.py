"""Training on torch.distributed.pipelining's own runtime with the lab around it: the engine, its state on disk and
the stages it builds from an export bundle."""
