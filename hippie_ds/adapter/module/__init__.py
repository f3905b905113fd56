"""The user's model: ``hippie_ds.PipelineModule`` (plan boundaries, chunks, re-computation), the config it discovers,
its deferred layers, and calls on its tensors."""
