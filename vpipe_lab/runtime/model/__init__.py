"""Model intake: a user's ``nn.Module`` captured with ``torch.export``, cut into named units, and the data it trains
on split into micro-batches. It may import torch, ``vpipe_lab.core`` and ``vpipe_lab.wire``; nothing else of the
runtime (the engine runs what it makes, it knows nothing of the engine)."""
