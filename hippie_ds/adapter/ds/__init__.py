"""The one package that reaches DeepSpeed's internals: every ``deepspeed.runtime`` import of hippie-ds,
and every private DeepSpeed name it reads, sets or calls, as named operations whose docstrings say
roughly what DeepSpeed thing they reach. The rest of the adapter, and tools/, call these.

* :mod:`.engine` -- ``PipelineEngine`` (the class the engine subclasses), its instruction map,
  pipe buffers and p2p state, stock handlers, and ``DeepSpeedEngine``'s backward and step internals;
* :mod:`.module` -- ``PipelineModule``, ``LayerSpec`` / ``TiedLayerSpec``, a built module's layer
  specs, topology and layer range;
* :mod:`.zero` -- ZeRO-1's per-stage step (``DeepSpeedZeroOptimizer``), ``BF16_Optimizer``'s accumulator;
* :mod:`.fp16` -- ``FP16_UnfusedOptimizer``'s scale and overflow check;
* :mod:`.schedule` -- DeepSpeed's instruction and schedule classes (``deepspeed.runtime.pipe.schedule``);
* :mod:`.checkpoint` -- the model-state files a load reads;
* :mod:`.runtime` -- ``deepspeed.runtime``'s config classes and gradient-norm utilities.

The names reached are :data:`hippie_ds._compat.SEAMS` (checked to exist on the installed DeepSpeed);
the subclasses' overrides of private methods are :data:`hippie_ds._compat.OVERRIDES`;
``tests/compat/test_seams.py`` checks that nothing outside this package (and ``_compat``) imports
``deepspeed.runtime`` or reaches those names, and that every SEAMS entry is used here.
Public DeepSpeed (``deepspeed.comm``, ``deepspeed.utils.logger``, ``deepspeed.accelerator``,
``deepspeed.pipe``) is imported where it is used. Importing this package imports none of its modules.
"""
