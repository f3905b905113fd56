"""``hippie.profile``: the running job measures its own layers into one profile file.

``hippie-ds profile`` (:mod:`hippie_ds.profiler`) needs the layer list and a sample in one process;
a model that only its framework can build (Megatron's ``GPTModelPipe``) cannot be profiled that
way. With ``"hippie": {"profile": {"out": FILE}}`` the engine does it in the job, on every stage's
own devices, inputs and shapes (:func:`profile_in_place` runs each ``train_batch`` call inside
:meth:`InPlaceProfiler.train_batch`, through the engine's public ``add_train_batch_hook``):

* the first ``train_batch`` call is a warm-up (kernels, allocator, communicators) and is not
  measured; during each of the next ``steps`` calls a forward pre-hook on the ``PipelineModule``
  keeps, per model chunk (virtual stages), a detached copy of the input of the chunk's first
  micro-batch. After the call returns (the schedule ran unchanged), each of the stage's layers is
  re-run in isolation on its real input (the chunk's input through the layers before it), by
  :func:`hippie_ds.adapter.profiling.layer_timing.measure_layer`: forward, backward, W (backward_weight) and
  what the split backward costs beyond the whole one (split_extra), both from the engine's own
  split run on the layer, re-compute, output bytes, bytes saved for backward, parameter bytes, and on CUDA the working
  memory (the allocator's peak over one more forward+backward, less what the layer keeps; it
  resets the device's peak statistic); medians over ``repeats`` timed runs after one untimed
  run. The backward is ``torch.autograd.grad`` towards the inputs and the layer's parameters:
  no ``.grad`` is written and no gradient hook runs; the RNG states are restored afterwards, so
  training goes on exactly as without the key;
* a layer is whatever the stage built: a module, a function or lambda (no parameters: param
  bytes 0, W 0), a tied module through its ``forward_fn`` (its parameter bytes at its first use
  in the layer list only), and its input may be a tuple (tensors that need no gradient, such as
  integer ones, pass through). Layer indices are global (``PipelineModule._layer_specs``), also
  with several chunks per stage;
* the loss: the stage holding the last layer wraps ``loss_fn`` during each measured call to keep
  a copy of the first micro-batch's labels, and measures ``loss_fn(output, labels)`` like a layer
  on the last layer's re-run output: the profile's ``loss`` entry (not a layer: the layer list and
  the fingerprint stay the specs'); none when the module has no ``loss_fn``;
* clock: CUDA events on a CUDA device (no synchronisation inside a timed run), the wall clock
  (``time.perf_counter``) elsewhere;
* after the last measured call every rank sends its layers' per-step records to all
  (``all_gather_object`` over the world group); per layer the median of every timed run of every
  measured step and data-parallel replica holding it, and its spread (:mod:`hippie_ds.planner.noise`:
  layers that are the same work, on any stage, are one group sharing the pooled median; a group
  whose members part by more than 25% makes rank 0 warn that the profile is noisy). The profile
  records the machine's load while measuring (``load``: load average before and after, the ranks'
  CPU over wall seconds of their measuring). Global rank 0 writes the profile: layer names and parameter
  bytes as :func:`hippie_ds.adapter.module.pipeline_module.model_fingerprint` computes them (from the layer
  specs, so ``hippie-ds plan`` and ``hippie_ds.PipelineModule(plan=...)`` recognise the model),
  micro-batch size ``train_micro_batch_size_per_gpu``, the job's shape (``job``: stages,
  data-parallel replicas, micro-batch size, ``train_batch_size``, model chunks per stage; what
  ``hippie-ds plan`` keeps unless told otherwise); ``param_dtype`` the dtype the job's
  parameters have (bf16 under DeepSpeed's bf16), ``param_bytes_dtype`` the one the specs' bytes
  count (fp32-sized for a model built in fp32). Rank 0 prints a line per measured step and
  what it wrote.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from deepspeed import comm as dist
from deepspeed.pipe import TiedLayerSpec

from ...planner.noise import RUNS, noise_warning, pool
from ...planner.profile import LayerProfile, Profile, save_profile
from ...planner.profile_fields import JobShape, MeasuredLoad
from ..ds import module as ds_module
from ..process.failure import end_job_on_failure
from .layer_timing import (
    as_stage_input,
    attribute_saved,
    bytes_dtype,
    clock_for,
    loadavg,
    measure_layer,
    nbytes,
    param_dtype,
    work_key,
)
from ..module.pipeline_module import layer_name, layer_names, layer_param_bytes, tie_keys
from ..module.tensor_calls import tensor_bytes

WARMUP_CALLS = 1  # train_batch calls before the measured ones


def profile_in_place(options, module, add_train_batch_hook: Callable, **stage) -> "InPlaceProfiler":
    """Measure ``module``'s layers during its engine's first ``train_batch`` calls (``options``: a
    :class:`hippie_ds.config.ProfileConfig`); see the module docstring. ``add_train_batch_hook``: the
    engine's (it runs each call inside :meth:`InPlaceProfiler.train_batch`); ``stage``: what
    :class:`InPlaceProfiler` is built with beside the module and the options."""
    profiler = InPlaceProfiler(module, options, **stage)
    add_train_batch_hook(profiler.train_batch)
    return profiler


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.Tensor.clone(torch.Tensor.detach(x))
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


class InPlaceProfiler:
    """Built with what it reads: the stage's ``module`` (a ``PipelineModule``), the ``options``, the
    engine's ``device``, its ``stage`` and global ``rank``, its data-parallel index (``replica``) and the
    job's ``data_parallel`` size, ``micro_batch_size`` and ``global_batch`` (``train_batch_size``)."""

    def __init__(
        self,
        module,
        options,
        *,
        device,
        stage: int,
        rank: int,
        replica: int,
        data_parallel: int,
        micro_batch_size: int,
        global_batch: int,
    ):
        self.options, self.module, self.device, self.stage, self.rank = options, module, device, stage, rank
        self.replica, self.data_parallel = replica, data_parallel
        self.micro_batch_size, self.global_batch = micro_batch_size, global_batch
        self.specs = list(ds_module.layer_specs(self.module))
        self.calls = 0
        self.records: dict[int, list[dict]] = {}  # global layer index -> one record per measured step
        self.input_bytes: float | None = None
        self.captured: dict[int, Any] = {}
        self.labels: Any = None  # the first micro-batch's labels of this call (the loss stage)
        self.loss_records: list[dict] = []
        self.profile: Profile | None = None  # rank 0, once written
        self.clock = clock_for(device)
        self.keys: dict[int, str | None] = {}  # global layer index -> its work key (noise.pool's groups)
        self.busy = {"cpu": 0.0, "wall": 0.0, "load_before": None}  # this rank's measuring: CPU, wall seconds

    # -- this stage's layers -------------------------------------------------------------------
    def chunks(self) -> list[tuple[int, list]]:
        """(global index of its first layer, its layers) of every model chunk this stage holds."""
        module = self.module
        if getattr(module, "chunked", False):
            return [(view["local_range"][0], view["forward_funcs"]) for view in module._chunk_views]
        return [(ds_module.local_start(module), module.forward_funcs)]

    def layer_params(self, index: int, layer) -> tuple[list[torch.Tensor], float]:
        """(the parameters the layer uses, the bytes the profile gives it: a tied module's at
        its first use in the layer list only)."""
        spec = self.specs[index]
        if isinstance(spec, TiedLayerSpec):
            params = list(self.module.tied_modules[spec.key].parameters())
            first = next(i for i, s in enumerate(self.specs) if isinstance(s, TiedLayerSpec) and s.key == spec.key)
            return params, float(tensor_bytes(params)) if first == index else 0.0
        params = list(layer.parameters()) if isinstance(layer, torch.nn.Module) else []
        return params, float(tensor_bytes(params))

    # -- train_batch ---------------------------------------------------------------------------
    def train_batch(self, run):
        """One ``train_batch`` call (``run()`` runs it and returns its loss), measured after it when it
        is one of the ``steps`` after the warm-up."""
        call, self.calls = self.calls, self.calls + 1
        step = call - WARMUP_CALLS + 1  # 1-based measured step
        if not 1 <= step <= self.options.steps:
            return run()
        self.captured, self.labels = {}, None
        hook = self.module.register_forward_pre_hook(self._capture)
        restore = self._capture_labels()
        try:
            loss = run()
        finally:
            hook.remove()
            restore()
        try:
            started = time.perf_counter()
            count = self._measure()
            self._say(
                f"hippie-ds: profile step {step}/{self.options.steps}: measured {count} layers of stage "
                f"{self.stage} in {time.perf_counter() - started:.2f} s"
            )
            if step == self.options.steps:
                self._gather_and_write()
        except BaseException as exc:  # the other ranks would wait in the gather
            end_job_on_failure(exc, self.rank, f"stage {self.stage}'s in-place profile")
            raise
        return loss

    def _capture(self, module, args):
        key = getattr(module, "current_chunk", None) or 0
        if key not in self.captured:
            self.captured[key] = _clone(args[0] if len(args) == 1 else args)

    def _capture_labels(self):
        """Keep the first labels ``loss_fn`` sees in this call; returns what undoes it."""
        loss_fn = getattr(self.module, "loss_fn", None)
        if loss_fn is None or not any(start + len(funcs) == len(self.specs) for start, funcs in self.chunks()):
            return lambda: None

        def keep(labels):
            if self.labels is None:
                self.labels = _clone(labels)

        if isinstance(loss_fn, torch.nn.Module):  # a registered submodule: no attribute swap
            return loss_fn.register_forward_pre_hook(lambda m, args: keep(args[1])).remove

        def capture(outputs, labels):
            keep(labels)
            return loss_fn(outputs, labels)

        self.module.loss_fn = capture

        def restore():
            self.module.loss_fn = loss_fn

        return restore

    def _measure_loss(self, output) -> None:
        """The loss on the last layer's ``output`` and the kept labels, measured like a layer."""
        loss_fn = self.module.loss_fn
        params = list(loss_fn.parameters()) if isinstance(loss_fn, torch.nn.Module) else []
        measured = measure_layer(
            lambda pair: loss_fn(pair[0], pair[1]),
            (as_stage_input(output), self.labels),
            params,
            float(tensor_bytes(params)),
            repeats=self.options.repeats,
            warmup=1,
            clock=self.clock,
            accumulate=False,
        )
        self.loss_records.append(dict(measured.record, input_bytes=float(nbytes((output, self.labels)))))
        self.labels = None

    def _measure(self) -> int:
        """Re-run every local layer on its input of this step; one record each."""
        cuda = self.clock.name == "CUDA events"
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if cuda else None
        grads = [(p, p.grad) for p in self.module.parameters()]
        count = 0
        if self.busy["load_before"] is None:
            self.busy["load_before"] = loadavg()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            with torch.enable_grad():
                for chunk, (start, funcs) in enumerate(self.chunks()):
                    if chunk not in self.captured:
                        raise RuntimeError(
                            f"hippie.profile: stage {self.stage}'s model chunk {chunk} ran no "
                            "forward in this train_batch call"
                        )
                    x = self.captured.pop(chunk)
                    if start == 0:
                        self.input_bytes = float(nbytes(x))
                    for offset, layer in enumerate(funcs):
                        params, size = self.layer_params(start + offset, layer)
                        inp = as_stage_input(x)
                        self.keys[start + offset] = work_key(
                            layer_name(self.specs[start + offset]),
                            params,
                            inp,
                            tied=isinstance(self.specs[start + offset], TiedLayerSpec),
                        )
                        measured = measure_layer(
                            layer,
                            inp,
                            params,
                            size,
                            repeats=self.options.repeats,
                            warmup=1,
                            clock=self.clock,
                            accumulate=False,
                        )
                        self.records.setdefault(start + offset, []).append(measured.record)
                        x = measured.output
                        count += 1
                    if start + len(funcs) == len(self.specs) and self.labels is not None:
                        self._measure_loss(x)
        finally:
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng)
            for p, g in grads:
                p.grad = g
            self.busy["wall"] += time.perf_counter() - wall
            self.busy["cpu"] += time.process_time() - cpu
        return count

    # -- the profile ---------------------------------------------------------------------------
    def _gather_and_write(self) -> None:
        mine = {
            "replica": int(self.replica),
            "layers": self.records,
            "input_bytes": self.input_bytes,
            "loss": self.loss_records,
            "dtype": param_dtype(list(self.module.parameters())),
            "keys": self.keys,
            "busy": self.busy,
        }
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            return
        self.profile = self.assemble(gathered)
        out = Path(self.options.out)
        save_profile(self.profile, out)
        self._say(
            f"hippie-ds: profile of {self.profile.num_layers} layers, micro-batch {self.profile.batch_size}, "
            f"measured in place over {self.options.steps} train_batch calls after {WARMUP_CALLS} warm-up "
            f"({self.options.repeats} timed runs per layer per call) on {self.device} with "
            f"{self.clock.name}: wrote {out}"
        )
        warning = noise_warning(self.profile)
        if warning:
            self._say("hippie-ds: " + warning)

    def assemble(self, gathered: list[dict]) -> Profile:
        """The profile from every rank's records: per layer, the median over steps, then over
        the replicas holding it; sizes from the lowest data-parallel index."""
        names = layer_names(self.specs)
        held: dict[int, list[tuple[int, list[dict]]]] = {}
        input_bytes, losses = None, []
        for rank in gathered:
            for index, steps in rank["layers"].items():
                held.setdefault(int(index), []).append((rank["replica"], steps))
            if rank["input_bytes"] is not None:
                input_bytes = rank["input_bytes"]
            if rank["loss"]:
                losses.append((rank["replica"], rank["loss"]))
        dtype = next((rank["dtype"] for rank in gathered if rank["dtype"] is not None), None)
        missing = [i for i in range(len(self.specs)) if i not in held]
        if missing:
            raise RuntimeError(f"hippie.profile: no stage measured layers {missing} of {len(self.specs)}")
        keys = {int(i): k for rank in gathered for i, k in rank.get("keys", {}).items()}
        records, groups = pool(
            [
                dict(_combine(held[index]), name=names[index], input_bytes=input_bytes if index == 0 else None)
                for index in range(len(self.specs))
            ],
            [keys.get(i) for i in range(len(self.specs))],
        )
        layers = [
            LayerProfile(**fields, tied_key=key) for fields, key in zip(attribute_saved(records), tie_keys(self.specs))
        ]
        measured = sum(x.param_bytes for x in layers)
        sizes = layer_param_bytes(self.specs)  # as model_fingerprint counts them (the dtype they are built in)
        if sizes is not None:
            layers = [x.model_copy(update={"param_bytes": s}) for x, s in zip(layers, sizes)]
        loss = None
        if losses:  # the loss saves for itself; the logits it receives are the last layer's output
            name = getattr(self.module.loss_fn, "__name__", None) or type(self.module.loss_fn).__name__
            loss = LayerProfile(**attribute_saved(pool([dict(_combine(losses), name=name)], [None])[0])[0])
        module = self.module
        busy = [rank["busy"] for rank in gathered if rank.get("busy")]
        wall = sum(b["wall"] for b in busy)
        load = MeasuredLoad(
            cpus=os.cpu_count(),
            load_before=next((b["load_before"] for b in busy if b["load_before"] is not None), None),
            load_after=loadavg(),
            wall_seconds=max((b["wall"] for b in busy), default=None),
            cpu_share=sum(b["cpu"] for b in busy) / wall if wall > 0 else None,
        )
        return Profile(
            model=self.options.name or type(module).__name__,
            job=self.job_shape(),
            load=load,
            groups=groups or None,
            steps=int(self.options.steps),
            batch_size=int(self.micro_batch_size),
            layers=layers,
            loss=loss,
            param_dtype=dtype,
            param_bytes_dtype=bytes_dtype(dtype, sum(x.param_bytes for x in layers), measured),
            source=f"hippie.profile: in place, {module.num_stages} stages x "
            f"{dist.get_world_size() // module.num_stages} replicas"
            f"{f' x {module.virtual_stages} chunks' if getattr(module, 'chunked', False) else ''}, "
            f"{self.options.steps} steps on {self.device}, {self.clock.name}",
        )

    def job_shape(self) -> JobShape:
        """The job's shape: its stages (the module's, from ``num_stages=`` or ``topology=``), data-parallel
        replicas, micro-batch size, global batch (``train_batch_size``) and model chunks per stage."""
        module = self.module
        return JobShape(
            stages=int(module.num_stages),
            data_parallel=int(self.data_parallel),
            micro_batch_size=int(self.micro_batch_size),
            global_batch=int(self.global_batch),
            virtual_stages=int(module.virtual_stages) if getattr(module, "chunked", False) else 1,
        )

    def _say(self, line: str) -> None:
        if dist.get_rank() == 0:
            print(line, flush=True)


def _combine(replicas: list[tuple[int, list[dict]]]) -> dict:
    """One record from (data-parallel index, per-step records) of every replica: every timed run of
    every step and replica pooled (``forward_runs``, ``backward_runs``: :func:`noise.pool` takes their
    medians), W and the split's extra the median over steps, then over replicas; the working memory the largest; sizes
    the lowest index's."""
    replicas = sorted(replicas, key=lambda r: r[0])
    record = dict(replicas[0][1][0])
    for key in RUNS:
        record[key] = [t for _, steps in replicas for s in steps for t in s[key]]
    record["backward_weight"] = statistics.median(
        statistics.median(s["backward_weight"] for s in steps) for _, steps in replicas
    )
    extras = [
        statistics.median(e)
        for _, steps in replicas
        if (e := [s["split_extra"] for s in steps if s.get("split_extra") is not None])
    ]
    record["split_extra"] = statistics.median(extras) if extras else None
    peaks = [s["working_bytes"] for _, steps in replicas for s in steps if s["working_bytes"] is not None]
    record["working_bytes"] = max(peaks) if peaks else None
    return record
