"""``HippiePipelineEngine``: the class, its loop, DeepSpeed's overrides, the instruction handlers and p2p; virtual stages' chunk selection and the call cursor."""
