"""The DeepSpeed adapter: the only modules that import DeepSpeed or touch torch at run time.

``engine`` (``HippiePipelineEngine``) with its parts ``engine_gradients``, ``engine_versions``,
``engine_checkpoint`` and ``engine_split``; ``instructions`` (a compiled schedule as DeepSpeed
``PipeInstruction``s); ``integration`` (``hippie_ds.initialize``); ``pipeline_module`` and
``checkpointing`` (``hippie_ds.PipelineModule``); ``split_backward``, ``staleness``, ``memory``
and ``checkpoint_state`` (torch-level helpers). Importing this package imports nothing of them.
"""
