"""Checkpoints: the format of hippie-ds's state in DeepSpeed's client state, and the in-flight state a save gathers and
a load restores."""
