"""``hippie_ds.PipelineModule``: DeepSpeed's ``PipelineModule`` whose stage boundaries and
per-layer activation checkpointing come from a planner plan file.

DeepSpeed partitions layers only by its own rules ('uniform', 'parameters', 'type:...'; no
explicit boundaries: DeepSpeed issue #2974) and checkpoints every ``interval`` layers. With
``plan=`` (a path, a :class:`~hippie_ds.planner.plan.Plan`, or ``config=`` naming one under
``hippie.plan``) this subclass

* checks, before DeepSpeed creates any process group, that the plan was made for this model
  (layer count, layer names and parameter sizes: the profile's fingerprint, computed from the
  layer specs on the meta device) and this job (world size, stage count);
* uses the plan's ``boundaries`` as DeepSpeed's ``parts``; a plan with virtual stages gives the
  model chunks too (its ``virtual_stages`` and ``layout``; ``pipeline_depth`` is the stage count K
  and ``boundaries`` cut K·v parts), ahead of the config's schedule, which ``hippie_ds.initialize``
  merges in from the plan;
* re-computes exactly the plan's ``checkpointed_layers``: each maximal run of consecutive
  checkpointed layers of a stage is one :func:`hippie_ds.adapter.module.recompute.recompute_run`.

Built without ``config=`` (as Megatron-DeepSpeed's and GPT-NeoX's pipe models build DeepSpeed's
class), it takes the config the script names (:mod:`hippie_ds.adapter.module.config_discovery`:
``hippie_ds.set_config``, else ``--deepspeed_config`` in ``sys.argv``), says on rank 0 where it came
from when that changes the layout, and records it for ``hippie_ds.initialize``'s checks.

Without a plan and virtual stages it is DeepSpeed's ``PipelineModule`` unchanged. Layer names and the
fingerprint are shared with the profiler (:func:`layer_names`, :func:`model_fingerprint`), so
a profile, the plan made from it and the model it came from agree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
from deepspeed import comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule as _DSPipelineModule, TiedLayerSpec

from ...config import ConfigError, read_config, split_config
from ...planner.job_shape import format_changes, shape_changes
from ...planner.plan_file import Plan, PlanMismatchError, load_plan
from ...planner.profile import PlannerError, fingerprint_of
from .recompute import recompute_run
from .config_discovery import FoundConfig, discover
from ..ds import module as ds_module
from .chunks import ChunkedLayers, chunks_phrase
from .tensor_calls import tensor_bytes


def layer_name(layer: Any) -> str:
    """The name a profile gives a layer: its class (or function) name."""
    if isinstance(layer, TiedLayerSpec):
        return f"{layer.typename.__name__}[{layer.key}]"
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, torch.nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def layer_names(layers: Sequence[Any]) -> list[str]:
    return [layer_name(x) for x in layers]


def tie_keys(layers: Sequence[Any]) -> list[str | None]:
    """Each layer's tie key (``TiedLayerSpec.key``), None for the others: a profile's ``tied_key``."""
    return [layer.key if isinstance(layer, TiedLayerSpec) else None for layer in layers]


def layer_param_bytes(layers: Sequence[Any]) -> list[float] | None:
    """Parameter bytes of every layer, built on the meta device (no memory, no compute). A tied
    layer counts its parameters at its first use only. None when a layer cannot be built there."""
    out, seen = [], set()
    try:
        with torch.device("meta"):
            for layer in layers:
                if isinstance(layer, TiedLayerSpec):
                    if layer.key in seen:
                        out.append(0.0)
                        continue
                    seen.add(layer.key)
                if isinstance(layer, LayerSpec):
                    module = layer.build()
                elif isinstance(layer, torch.nn.Module):
                    module = layer
                else:
                    out.append(0.0)
                    continue
                out.append(float(tensor_bytes(module.parameters())))
    except Exception:  # a constructor that needs real tensors: skip the parameter check
        return None
    return out


def model_fingerprint(layers: Sequence[Any]) -> str | None:
    sizes = layer_param_bytes(layers)
    return None if sizes is None else fingerprint_of(layer_names(layers), sizes)


def resolve_plan(
    plan: str | os.PathLike | Plan | None = None,
    config: str | os.PathLike | dict | None = None,
    config_path: str | os.PathLike | None = None,
) -> Plan | None:
    """The plan given, or the one the DeepSpeed config names under ``hippie.plan`` (a path
    relative to the config file's directory when the config is a file; ``config_path``: that file,
    for a config already read)."""
    if isinstance(plan, Plan):
        return plan
    if plan is not None:
        return load_plan(plan)
    if config is None:
        return None
    data = read_config(config)
    path = (data.get("hippie") or {}).get("plan")
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(
            f'config key "hippie.plan" = {path!r}: must be the path of a plan file (written by `hippie-ds plan --out`)'
        )
    return load_plan(
        locate_plan(
            path, config_path if config_path is not None else config if isinstance(config, (str, os.PathLike)) else None
        )
    )


def locate_plan(path: str | os.PathLike, config_path: str | os.PathLike | None) -> Path:
    """The file config key ``hippie.plan`` names: as given (absolute, or relative to the working
    directory), else relative to the config file's directory."""
    found = Path(path)
    if not found.is_absolute() and not found.exists() and config_path is not None:
        found = Path(config_path).resolve().parent / found
    if not found.exists():
        raise ConfigError(f'config key "hippie.plan" = {str(path)!r}: no such file')
    return found


def stages_source(num_stages: int | None, topology: Any, owner: str | None = None) -> str:
    """Where a module's stage count came from, as the refusals name it: ``topology=`` (its class and
    dimensions, and the model class that passed it) or ``num_stages=``."""
    if topology is None:
        return f"num_stages={num_stages}"
    axes = getattr(topology, "axes", None) or []
    dims = getattr(topology, "dims", None) or []
    shape = ", ".join(f"{a}={d}" for a, d in zip(axes, dims))
    by = f", passed by the model class {owner}" if owner else ""
    return f"topology= (a {type(topology).__name__} with {shape}{by})"


def module_stages_source(module) -> str | None:
    """:func:`stages_source` of a built module: recorded by ``hippie_ds.PipelineModule``; for DeepSpeed's
    class, its topology (DeepSpeed builds a ``PipeDataParallelTopology`` from ``num_stages=``)."""
    recorded = getattr(module, "hippie_stages_from", None)
    if recorded is not None:
        return recorded
    topo = ds_module.topology(module)
    if topo is None:
        return None
    if type(topo).__name__ == "PipeDataParallelTopology":
        return f"num_stages={topo.get_dim('pipe')} (or a PipeDataParallelTopology passed as topology=)"
    return stages_source(None, topo, type(module).__name__)


def check_plan(
    plan: Plan,
    layers: Sequence[Any],
    *,
    world_size: int | None,
    num_stages: int | None,
    virtual_stages: int | None = None,
    layout: str | None = None,
    stages_from: str | None = None,
) -> None:
    """Raise :class:`PlanMismatchError` when ``plan`` does not fit this model or job: ``num_stages``
    (pipeline ranks; ``stages_from``: where the module got that count, :func:`stages_source`) and
    ``world_size`` against the plan's, naming the changes that run the plan
    (:func:`hippie_ds.planner.job_shape.shape_changes`); ``virtual_stages`` / ``layout`` (the module's
    model chunks per stage, None: not known yet) against the plan's, and its K·v+1 boundaries."""
    plan.check_matches(num_layers=len(layers))
    stages_differ = num_stages is not None and num_stages != plan.pipeline_depth
    if stages_differ or (world_size is not None and world_size != plan.world_size):
        chunks = f" x {plan.virtual_stages} model chunks each" if plan.virtual_stages > 1 else ""
        where = stages_from or (f"num_stages={num_stages}" if num_stages is not None else None)
        has = [f"{num_stages} pipeline stages" + (f" (from {where})" if where else "")] if num_stages else []
        has += [f"{world_size} ranks"] if world_size is not None else []
        kind = (
            "topology="
            if where and where.startswith("topology=")
            else "num_stages="
            if where and where.startswith("num_stages=")
            else None
        )
        changes = shape_changes(plan, stages=num_stages, world_size=world_size, stages_from=kind)
        again = f" --stages {num_stages}" if num_stages else ""
        raise PlanMismatchError(
            f"this job has {' on '.join(has)}, but the plan for {plan.model!r} has {plan.pipeline_depth} "
            f"stages{chunks} "
            f"x {plan.data_parallel} data-parallel replicas on {plan.world_size} ranks (boundaries {plan.boundaries}). "
            + format_changes(changes, "To run this plan, change:")
            + f"\nOr plan for this job's shape: hippie-ds plan --profile ...{again} (a profile measured in place "
            "keeps the job's shape)"
        )
    parts = plan.pipeline_depth * plan.virtual_stages
    if len(plan.boundaries) != parts + 1:
        raise PlanMismatchError(
            f"the plan's boundaries {plan.boundaries} cut {len(plan.boundaries) - 1} model parts; "
            f"its {plan.pipeline_depth} stages x {plan.virtual_stages} virtual stages need {parts}"
        )
    if virtual_stages is not None and (virtual_stages, layout if virtual_stages > 1 else None) != (
        plan.virtual_stages,
        plan.layout if plan.virtual_stages > 1 else None,
    ):
        raise PlanMismatchError(
            f"the module holds {chunks_phrase(virtual_stages, layout)}, but the plan for "
            f"schedule {plan.schedule!r} has {chunks_phrase(plan.virtual_stages, plan.layout)} "
            f"(boundaries {plan.boundaries})"
        )
    fp = model_fingerprint(layers)
    if fp is not None and fp != plan.fingerprint:
        raise PlanMismatchError(
            f"the plan is for {plan.model!r} (fingerprint {plan.fingerprint}); this model's "
            f"layer names or parameter sizes differ (fingerprint {fp}; layers "
            f"{_short(layer_names(layers))}): the plan was made for another model. Profile this "
            "model (`hippie-ds profile`) and plan again"
        )


def _short(names: list[str], limit: int = 6) -> str:
    return ", ".join(names if len(names) <= limit else names[:limit] + [f"... ({len(names)} layers)"])


def chunks_of_plan(plan: Plan, virtual_stages: int | None, layout: str | None) -> tuple[int, str]:
    """(model chunks per stage, layout) of a module built from ``plan``: the plan's. Constructor
    arguments that say otherwise are refused, naming both values."""
    wanted = (plan.virtual_stages, plan.layout)
    if virtual_stages is not None and virtual_stages != plan.virtual_stages:
        raise PlanMismatchError(
            f"virtual_stages={virtual_stages!r}, but the plan for schedule {plan.schedule!r} has "
            f"virtual_stages {plan.virtual_stages} (boundaries {plan.boundaries}); leave "
            "virtual_stages out to take the plan's"
        )
    if layout is not None and layout != plan.layout and plan.virtual_stages > 1:
        raise PlanMismatchError(
            f"layout={layout!r}, but the plan for schedule {plan.schedule!r} places its "
            f"{plan.virtual_stages} model chunks per stage in the {plan.layout!r} layout; leave "
            "layout out to take the plan's"
        )
    return wanted


def virtual_stages_of(config: str | os.PathLike | dict | None, num_stages: int | None) -> tuple[int, str]:
    """(model chunks per stage, layout) the config's schedule runs: ``pipeline.virtual_stages`` or the
    schedule's own; (1, 'interleaved') without a config."""
    if config is None:
        return 1, "interleaved"
    from ...schedules.compiler import resolve_virtual_stages
    from ...schedules.spec import load_spec

    _, schedule, options = split_config(read_config(config))
    spec = load_spec(schedule)
    return resolve_virtual_stages(spec, num_stages or 1, 1, options.virtual_stages), spec.layout


_ANNOUNCED: set[str] = set()


def announce(found: FoundConfig, virtual_stages: int, layout: str, plan: Plan | None) -> None:
    """Once per process: where the layout a module built without ``config=`` came from."""
    if plan is None:
        what = [f"schedule {split_config(found.config)[1]!r}: {chunks_phrase(virtual_stages, layout)}"]
    else:  # the plan's schedule and chunks (initialize merges its schedule into the config)
        what = [
            f"the plan for {plan.model!r} (schedule {plan.schedule!r}: {chunks_phrase(virtual_stages, layout)}; "
            f"boundaries {plan.boundaries})"
        ]
    line = (
        f"hippie-ds: PipelineModule built without config=, from the DeepSpeed config {found.source}: "
        + " and ".join(what)
    )
    if line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        print(line, flush=True)


def recompute_runs(local: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs [start, stop) of consecutive local layer indices."""
    runs = []
    for i in sorted(local):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class PipelineModule(ChunkedLayers, _DSPipelineModule):
    """DeepSpeed's ``PipelineModule`` plus ``plan=`` / ``config=`` (see the module docstring).

    ``checkpointed_layers`` (global layer indices) re-computes those layers without a plan.
    ``virtual_stages`` (default: the plan's, else what ``config``'s schedule runs, else 1) builds that many model
    chunks per stage, placed by ``layout`` (:mod:`hippie_ds.adapter.module.chunks`)."""

    def __init__(
        self,
        layers,
        num_stages=None,
        topology=None,
        *,
        plan: str | os.PathLike | Plan | None = None,
        config: str | os.PathLike | dict | None = None,
        checkpointed_layers: Sequence[int] | None = None,
        virtual_stages: int | None = None,
        layout: str | None = None,
        **kwargs,
    ):
        layers = list(layers)
        found = discover() if config is None else None  # the script's config: set_config, sys.argv
        source = found.source if found is not None else ("config=" if config is not None else None)
        path = found.path if found is not None else (str(config) if isinstance(config, (str, os.PathLike)) else None)
        config = found.config if found is not None else (None if config is None else read_config(config))  # once
        resolved = resolve_plan(plan, config, path)
        stages = topology.get_dim("pipe") if topology is not None else num_stages
        if resolved is not None:  # the plan's chunks (the config may name its schedule only in initialize)
            virtual_stages, layout = chunks_of_plan(resolved, virtual_stages, layout)
        elif virtual_stages is None:
            virtual_stages, found_layout = virtual_stages_of(config, stages)
            layout = layout or found_layout
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"virtual_stages = {virtual_stages!r}: must be an integer >= 1")
        self._init_chunks(virtual_stages, layout or "interleaved")
        if resolved is not None:
            world = dist.get_world_size() if dist.is_initialized() else None
            check_plan(
                resolved,
                layers,
                world_size=world,
                num_stages=stages,
                virtual_stages=virtual_stages,
                layout=layout,
                stages_from=stages_source(stages, topology, self._owner()),
            )
            if topology is None and num_stages is None:
                num_stages = resolved.pipeline_depth
            if checkpointed_layers is not None and sorted(checkpointed_layers) != resolved.checkpointed_layers:
                raise PlanMismatchError(
                    f"checkpointed_layers={sorted(checkpointed_layers)} differs from the plan's "
                    f"{resolved.checkpointed_layers}; give one or the other"
                )
            checkpointed_layers = resolved.checkpointed_layers
            if kwargs.get("activation_checkpoint_interval", 0):
                raise PlanMismatchError(
                    "activation_checkpoint_interval with a plan: the plan chooses the "
                    "checkpointed layers; leave the interval at 0"
                )
        bad = [i for i in (checkpointed_layers or ()) if not 0 <= int(i) < len(layers)]
        if bad:
            raise ValueError(f"checkpointed_layers {bad}: outside 0..{len(layers) - 1}")
        # Set before DeepSpeed's __init__, which calls _partition_layers.
        object.__setattr__(self, "hippie_plan", resolved)
        object.__setattr__(self, "hippie_config_source", source)  # where config came from (initialize's refusals)
        object.__setattr__(
            self, "hippie_stages_from", stages_source(stages, topology, self._owner()) if stages is not None else None
        )  # None: the plan's (num_stages left out)
        object.__setattr__(self, "hippie_plan_source", source if plan is None and resolved is not None else None)
        object.__setattr__(self, "hippie_config", config)  # as read: initialize takes it, given the same config
        object.__setattr__(self, "hippie_config_path", path)
        object.__setattr__(self, "_checkpointed", sorted({int(i) for i in checkpointed_layers or ()}))
        super().__init__(layers, num_stages=num_stages, topology=topology, **kwargs)
        if not self.chunked:
            self._local_runs = self._chunk_extra(*ds_module.local_range(self))["_local_runs"]
        if found is not None and (self.chunked or resolved is not None) and self.global_rank == 0:
            announce(found, self.virtual_stages, self.layout_kind, resolved)

    def _owner(self) -> str | None:
        """The model class that built this module (a subclass, as Megatron's GPTModelPipe), for the refusals."""
        return None if type(self) is PipelineModule else type(self).__name__

    def _chunk_extra(self, start: int, stop: int) -> dict:
        local = [i - start for i in self._checkpointed if start <= i < stop]
        return {"_local_runs": recompute_runs(local)}

    def _build(self):
        if not self.chunked:
            return super()._build()
        self._build_chunks(super()._build)

    def stage_owner(self, layer_idx):
        return self.chunk_owner(layer_idx) if self.chunked else super().stage_owner(layer_idx)

    def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
        if not self.chunked:
            return super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
        self._each_chunk(
            lambda: super(PipelineModule, self).save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
        )

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        if not self.chunked:
            return super().load_state_dir(load_dir, checkpoint_engine, strict)
        self._each_chunk(lambda: super(PipelineModule, self).load_state_dir(load_dir, checkpoint_engine, strict))

    @property
    def checkpointed_layers(self) -> list[int]:
        return list(self._checkpointed)

    def _partition_layers(self, method="uniform"):
        if self.hippie_plan is not None and self.global_rank == 0:
            print(
                f"hippie-ds: {'model-part' if self.chunked else 'stage'} boundaries {self.hippie_plan.boundaries} "
                f"and checkpointed layers {self.hippie_plan.checkpointed_layers} from the plan for "
                f"{self.hippie_plan.model!r}",
                flush=True,
            )
        if self.chunked:
            return self._partition_chunks(method, None if self.hippie_plan is None else self.hippie_plan.boundaries)
        if self.hippie_plan is None:
            return super()._partition_layers(method=method)
        self.parts = list(self.hippie_plan.boundaries)
        stage_id = ds_module.stage_of_rank(self, self.global_rank)
        ds_module.set_bounds(self, self.parts[stage_id], self.parts[stage_id + 1])

    def forward(self, forward_input):
        if self.chunked and self.current_chunk is None:
            raise RuntimeError(
                f"this stage holds {self.virtual_stages} model chunks: the engine selects one "
                "(set_chunk) before running it"
            )
        if not self._local_runs:
            return super().forward(forward_input)
        if self.activation_checkpoint_interval:
            raise ValueError("checkpointed_layers and activation_checkpoint_interval together: use one")
        self.micro_offset += 1
        x, i = forward_input, 0
        for start, stop in self._local_runs + [(len(self.forward_funcs), None)]:
            if i < start:
                x = self._run(i, start, x)
            if stop is None:
                break
            args = x if isinstance(x, tuple) else (x,)
            x = recompute_run(lambda *a, _s=start, _e=stop: self._run(_s, _e, a[0] if len(a) == 1 else a), *args)
            i = stop
        return x

    def _run(self, start: int, stop: int, x):
        for idx, layer in enumerate(self.forward_funcs[start:stop]):
            self.curr_layer = start + idx + ds_module.local_start(self)
            if self.seed_layers:
                seed = self.base_seed * (self.micro_offset + 1) + self.curr_layer
                if self.seed_fn:
                    self.seed_fn(seed)
                else:
                    ds_module.set_random_seed(seed)
            x = layer(x)
        return x


__all__ = [
    "PipelineModule",
    "layer_names",
    "model_fingerprint",
    "resolve_plan",
    "locate_plan",
    "check_plan",
    "stages_source",
    "module_stages_source",
    "PlannerError",
]
