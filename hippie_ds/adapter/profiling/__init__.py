"""Measuring: in-place profiling, one layer's timing, activation memory, and the instruction timeline."""
