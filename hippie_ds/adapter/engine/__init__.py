"""``HippiePipelineEngine``: DeepSpeed's overrides and the public methods, each delegating to the stage
runtime (adapter/stage)."""
