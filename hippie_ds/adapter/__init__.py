"""The DeepSpeed adapter: the modules that import DeepSpeed, and the torch code they run (the standalone
profiler, ``hippie_ds/profiler.py``, touches torch too), in packages by concern. Importing this
package imports none of them.

Dependencies run one way: a package imports only the packages below it in :data:`PACKAGES`
(bottom first), never one above it (``tests/structure/test_structure.py`` checks it, that no module
outside ``engine/`` reads a private attribute of the engine, and that no component takes the engine:
each is built with what it reads, DeepSpeed's operations as objects made in ``ds``):

* ``ds`` -- the one package that reaches DeepSpeed's internals (``deepspeed.runtime``, private
  names), as named operations; the others call those, and use public DeepSpeed directly;
* ``process`` -- a handler that raises ends the job; gloo idle before the interpreter finalizes;
* ``module`` -- ``hippie_ds.PipelineModule`` (plan boundaries, chunks, re-computation), the config
  it discovers, its deferred layers, calls on user tensors;
* ``precision`` -- optimizer paths, fp16 votes, a virtual layout's clipping, the per-stage step;
* ``gradients`` -- the gradient store, the all-reduce stream and buffer, tied modules, the split backward;
* ``staleness`` -- weight versions and the staleness corrections;
* ``checkpoint`` -- the checkpoint's state format, and the in-flight state a save gathers and a load restores;
* ``profiling`` -- in-place profiling, layer timing, activation memory, the timeline;
* ``stage`` -- the stage runtime: what a stage owns, the loop over its ops, each op kind's handler, p2p,
  the chunks and the call cursor, and the factory of its components;
* ``engine`` -- ``HippiePipelineEngine``: DeepSpeed's overrides and the public methods, delegating to the runtime;
* ``startup`` -- the config and the plan read once, and every start-up check, in one order, before any
  process group;
* ``integration`` (a module) -- ``hippie_ds.initialize``, at the top.

:data:`ALIASES` are modules kept at paths that saved checkpoints pickled (they re-export the new place).
"""

PACKAGES = (
    "ds",
    "process",
    "module",
    "precision",
    "gradients",
    "staleness",
    "checkpoint",
    "profiling",
    "stage",
    "engine",
    "startup",
    "integration",
)
ALIASES = ("checkpoint_state",)
