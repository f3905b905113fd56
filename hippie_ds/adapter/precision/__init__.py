"""Optimizer paths and precision: which path a config takes, fp16's overflow votes, a virtual layout's clipping, and
the per-stage optimizer step."""
