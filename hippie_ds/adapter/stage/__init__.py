"""A pipeline stage as hippie-ds runs it: the stage runtime, its op handlers, its components' factory."""
