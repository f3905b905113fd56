"""The bench's rank scripts, each started by path on every rank by a job of ``tools.bench.cluster``
(the repository root on PYTHONPATH)."""
