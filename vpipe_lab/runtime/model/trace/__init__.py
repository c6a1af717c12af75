"""What capture needs beside torch.export: modules it cannot trace run eagerly (``eager.py``), why a trace failed in
words that name the fix (``problems.py``), and a model laid out on meta traced as on its stage's device
(``run_device.py``)."""
