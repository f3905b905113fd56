"""The DeepSpeed adapter: the modules that import DeepSpeed, and the torch code they run (the standalone
profiler, ``hippie_ds/profiler.py``, touches torch too). DeepSpeed's internals (``deepspeed.runtime``,
its private names) are reached in one package, ``ds`` (:mod:`hippie_ds.adapter.ds`), as named
operations; the other modules call those, and use public DeepSpeed (``deepspeed.comm``, ``deepspeed.pipe``,
the logger, the accelerator) directly.

``engine`` (``HippiePipelineEngine``) with its parts ``engine_gradients``, ``engine_versions``,
``engine_checkpoint``, ``engine_split``, ``engine_chunks`` and ``engine_step``; ``instructions`` (a compiled schedule as DeepSpeed
``PipeInstruction``s); ``integration`` (``hippie_ds.initialize``); ``pipeline_module`` and
``recompute`` (``hippie_ds.PipelineModule``); ``split_backward``, ``staleness``, ``memory``
and ``checkpoint_state`` (torch-level helpers). Importing this package imports nothing of them.
"""
