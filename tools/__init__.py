"""The tools beside the package (not installed with it): ``tools.examples``, the user examples
(``deepspeed tools/examples/train_gpt.py ...``), and ``tools.bench``, the bench (``python -m
tools.bench ...``). Imported from the repository root: ``from tools.bench.cluster import LocalJob``."""
