"""The DeepSpeed adapter: the modules that import DeepSpeed, and the torch code they run (the standalone
profiler, ``hippie_ds/profiler.py``, touches torch too).

``engine`` (``HippiePipelineEngine``) with its parts ``engine_gradients``, ``engine_versions``,
``engine_checkpoint`` and ``engine_split``; ``instructions`` (a compiled schedule as DeepSpeed
``PipeInstruction``s); ``integration`` (``hippie_ds.initialize``); ``pipeline_module`` and
``recompute`` (``hippie_ds.PipelineModule``); ``split_backward``, ``staleness``, ``memory``
and ``checkpoint_state`` (torch-level helpers). Importing this package imports nothing of them.
"""
