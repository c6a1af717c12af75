"""A stage's state on disk: checkpoint versions and manifests, torch.distributed.checkpoint state dicts read without
running code, and the snapshots a restarted job resumes from."""
