"""``HippiePipelineEngine``: DeepSpeed's ``PipelineEngine`` running any declared schedule.

The only module that touches DeepSpeed internals. What it changes, and why:
- ``_train_schedule`` returns the compiled, validated declaration instead of ``TrainSchedule``;
- the loss lives in per-buffer slots (the stock engine keeps one, so any order but strict
  F(m)->B(m) on the last stage breaks: DeepSpeed issue #3900). The received gradient keeps
  DeepSpeed's single slot: the compiler puts every recv_grad in its backward's step, and the
  engine refuses a schedule that would receive another gradient before using the one it holds;
- handlers for the new instructions (fused forward+backward, non-blocking sends, async
  per-stage all-reduce, gradient buffer, deferred update, per-stage optimizer step);
- the gradient buffer of deferred stages is saved in checkpoints and restored;
- deferred stages, and 2bw's stages, correct for their one-step delay (``hippie.staleness``,
  :mod:`hippie_ds.staleness`): compute runs on predicted weights, the update applies to the true ones;
- continuous schedules (2bw, pipedream: the pipeline stays full across ``train_batch`` calls):
  ops of batches still in flight run in the next call, ``drain()`` completes them; weight
  versions (below);
- optional per-rank timeline of executed instructions (Chrome trace).

Weight versions (schedules whose compute ops declare a ``version``). A stage's version counts its
updates. The module's parameters hold one version at a time; the others live as flat copies
(``_wv_store``): a compute op first swaps its version in (copying the parameters' values through
``.data``), an update swaps the current version in, and ``stash_weights`` keeps a copy of it before
it is overwritten. Autograd's saved-tensor check would reject a backward after an in-place optimizer
step on the parameters its forward saved; the engine guarantees (and the validator proves
statically) that the backward sees the values its forward used, so it restores the parameters'
version counters after each such step.

Per-stage update semantics (``StageOptimizerStep`` / ``ApplyBufferedUpdate``): the gradient
norm used for clipping (and bf16's overflow check) is this stage's own norm, reduced over the
stage's tensor-slice group only, not over the pipeline: a stage that updates early cannot wait
for the others, and a deferred stage applies last step's gradient. DeepSpeed's ``OptimizerStep``
(1f1b, gpipe) keeps the stock pipeline-wide norm.
"""
from __future__ import annotations

import collections
import json
import os
import time
from types import MethodType

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import logger
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import checkpoint_state as ckpt
from ._compat import check_deepspeed_version
from .schedules import deepspeed_schedule as hs
from .schedules.ir import COMPUTE_KINDS, CompiledSchedule, OpKind
from .schedules.simulator import CATEGORY, op_name
from .staleness import make_corrector

check_deepspeed_version()

GRAD_BUFFER_KEY = "hippie_ds_grad_buffer"
WEIGHT_PREDICTION_KEY = "hippie_ds_weight_prediction"
WEIGHT_VERSIONS_KEY = "hippie_ds_weight_versions"


def check_single_grad_slot(compiled: CompiledSchedule, stage: int) -> None:
    """DeepSpeed receives gradients into one reused tensor (``grad_layer``): a stage must run a
    micro-batch's backward before it receives the next gradient."""
    holding = None
    for op in compiled.ops(stage):
        if op.kind == OpKind.RECV_GRAD:
            if holding is not None:
                raise ValueError(f"schedule {compiled.name!r} stage {stage} step {op.step}: receives the gradient of "
                                 f"micro-batch {op.micro_batch} before the backward of micro-batch {holding}; "
                                 "hippie-ds receives a gradient in the step of its backward")
            holding = op.micro_batch
        elif op.kind == OpKind.BACKWARD and op.micro_batch == holding:
            holding = None


class _StageLocalMPU:
    """Proxy mpu whose model-parallel group is this stage's tensor-slice group: gradient norms
    (clipping, bf16 overflow) of a per-stage step reduce over the stage, not the pipeline."""

    def __init__(self, mpu, grid):
        self._mpu, self._grid = mpu, grid

    def get_model_parallel_group(self):
        return self._grid.get_slice_parallel_group()

    def get_model_parallel_world_size(self):
        return self._grid.get_slice_parallel_world_size()

    def get_model_parallel_rank(self):
        return self._grid.get_slice_parallel_rank()

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def __getattr__(self, name):
        return getattr(self._mpu, name)


class HippiePipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` whose training schedule is a compiled hippie-ds declaration."""

    def __init__(self, *args, compiled_schedule: CompiledSchedule, timeline_dir: str | None = None,
                 timeline_steps: int = 100, staleness=None, deferred_layers: dict[int, int] | None = None,
                 **kwargs):
        self.compiled_schedule = compiled_schedule
        super().__init__(*args, **kwargs)
        if compiled_schedule.stages != self.num_stages or compiled_schedule.micro_batches != self.micro_batches:
            raise ValueError(f"schedule compiled for {compiled_schedule.stages} stages x "
                             f"{compiled_schedule.micro_batches} micro-batches, engine has {self.num_stages} x "
                             f"{self.micro_batches}")
        self._declared = hs.DeclaredSchedule(compiled_schedule, self.stage_id)
        self._losses: dict[int, object] = {}
        self._pending_sends: list = []
        self._allreduce: dict[str, tuple | None] = {"grads": None, "buffer": None}
        self._grad_buffer: torch.Tensor | None = None
        self._grad_buffer_state = "empty"  # empty | filled | reducing | reduced
        self._timeline_dir = timeline_dir
        # events of the last `timeline_steps` train_batch calls only: a long run's memory stays flat
        self._timeline: collections.deque[dict] = collections.deque()
        self._timeline_steps = timeline_steps
        self._inflight: dict[str, float] = {}
        self._batch_index = 0
        self._training = False  # timelines cover train_batch only
        self._t0 = time.perf_counter()
        self._t0_unix = time.time()  # to align ranks' timelines (same host clock)
        # continuous schedules: calls run so far, the earliest batch not yet drained, whether
        # batches are in flight; weight versions (see the module docstring)
        self._continuous = compiled_schedule.continuous
        self._versioned = compiled_schedule.versioned
        self._call = 0
        self._first_batch = 0
        self._op_call = 0  # the call an op's relative batch refers to
        self._in_flight = False
        self._wv_updates = compiled_schedule.updates_per_batch[self.stage_id] if self._continuous else 0
        self._wv_count = 0  # updates applied: the current version
        self._wv_loaded = 0  # the version the module's parameters hold
        self._wv_store: dict[int, torch.Tensor] = {}  # versions not in the module (flat copies)
        self._wv_stashed: set[int] = set()
        self._wv_peak = 1
        self._current_op = None
        # A deferred stage delays the gradient of _delayed_params (all its parameters, or with
        # partial deferral those of its first layers); _synced_params are all-reduced and applied in-step.
        deferred = not self._continuous and self.stage_id in compiled_schedule.deferred_stages()
        self._delayed_params, self._synced_params = self._split_deferred(
            (deferred_layers or {}).get(self.stage_id)) if deferred else ([], self._version_params())
        # Partial deferral: the synchronous part's all-reduce starts inside the stage's last
        # backward, once those parameters' gradients are final (the delayed layers come later in
        # backward); the declared start_allreduce(grads) then finds it in flight.
        self._early_pending: set[int] | None = None
        self._last_backward_mb = max((op.micro_batch for op in compiled_schedule.ops(self.stage_id)
                                      if op.kind in (OpKind.BACKWARD, OpKind.FORWARD_BACKWARD)), default=None)
        if self._delayed_params and self._synced_params:
            for p in self._synced_params:
                p.register_post_accumulate_grad_hook(self._on_grad_final)
        if deferred and self.grid.data_parallel_id == 0:
            delayed = sum(p.numel() for p in self._delayed_params)
            logger.info(f"hippie-ds: stage {self.stage_id} applies {self.delayed_fraction():.1%} of its gradient one "
                        f"step late ({delayed} of {sum(p.numel() for p in self._version_params())} elements)")
        # staleness correction of a deferred stage (None: the plain one-step-delayed rule)
        self._corrector = None
        if staleness is not None and deferred and self._delayed_params:
            self._corrector = make_corrector(staleness, self._delayed_params)
        # ... and the same rule for versioned stages one update behind (2bw): compute ops run on
        # W(v) + c * (W(v) - W(v-1)); the deltas of the versions still computed on are kept
        self._wv_deltas: dict[int, torch.Tensor] | None = None
        self._wv_predicted = False  # the module holds the prediction of _wv_loaded (true copy in _wv_store)
        self._wv_coefficient = 0.0
        if (staleness is not None and staleness.method == "extrapolate" and self._versioned
                and compiled_schedule.one_version_behind(self.stage_id)):
            self._wv_deltas, self._wv_coefficient = {}, staleness.coefficient

    def _split_deferred(self, layers: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(delayed, synchronous) parameters of this deferred stage: those of its first ``layers``
        layers are delayed (all of them when ``layers`` is None)."""
        params = self._version_params()
        if layers is None:
            return params, []
        delayed = {id(p) for i, layer in enumerate(self.module.forward_funcs) if i < layers and
                   isinstance(layer, torch.nn.Module) for p in layer.parameters()}
        return [p for p in params if id(p) in delayed], [p for p in params if id(p) not in delayed]

    def delayed_fraction(self) -> float:
        """The fraction of this stage's gradient (by elements) that is applied one step late."""
        total = sum(p.numel() for p in self._version_params())
        return sum(p.numel() for p in self._delayed_params) / total if total else 0.0

    # ------------------------------------------------------------------ schedule
    def _train_schedule(self):
        return self._declared

    def _exec_schedule(self, pipe_schedule):
        # DeepSpeed's loop, plus an optional timeline of every executed instruction.
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self._exec_steps(pipe_schedule)

    def _exec_steps(self, steps):
        record = self._timeline_dir is not None and self._training
        continuous = self._continuous and self._training
        for step_cmds in steps:
            for cmd in step_cmds:
                op = getattr(cmd, "op", None)
                if continuous and op is not None and self._op_call + op.batch < self._first_batch:
                    continue  # a batch that does not exist (pipeline fill) or was drained
                handler = self._INSTRUCTION_MAP.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {cmd!r}")
                start = time.perf_counter()
                self._current_op = op
                if self._versioned and op is not None and op.kind in COMPUTE_KINDS and op.version is not None:
                    self._use_version(self._abs_version(op), predicted=self._wv_deltas is not None)
                MethodType(handler, self)(**cmd.kwargs)
                if record:
                    self._record(cmd, start, time.perf_counter())

    def _record(self, cmd, start, end):
        op = getattr(cmd, "op", None)
        event = {"name": op_name(op) if op else repr(cmd), "kind": type(cmd).__name__,
                 "category": CATEGORY.get(op.kind, "other") if op else "other", "start": start - self._t0,
                 "end": end - self._t0, "step": self._batch_index, "micro_batch": op.micro_batch if op else None}
        self._timeline.append(event)
        if op is not None and op.kind == OpKind.START_ALLREDUCE:
            self._inflight.setdefault(op.target, start)  # set earlier when the all-reduce started early
        elif op is not None and op.kind == OpKind.WAIT_ALLREDUCE and op.target in self._inflight:
            # In flight from its start until its wait returned (gloo reports no completion time).
            self._timeline.append({"name": f"allreduce({op.target})", "kind": "AllReduceInFlight", "category": "comm",
                                   "start": self._inflight.pop(op.target) - self._t0, "end": end - self._t0,
                                   "step": self._batch_index, "micro_batch": None})

    def train_batch(self, data_iter=None):
        self._training = True
        self._op_call = self._call
        try:
            if not self._continuous:
                if self._corrector is not None:
                    self._corrector.predict()  # restored by apply_buffered_update, before the step
                return super().train_batch(data_iter)
            # Updates of a continuous schedule keep the step counters still; the call advances
            # them once, on every stage alike (checkpoint tags and LR schedules count batches).
            loss = super().train_batch(data_iter)
            self._step_bookkeeping()
            self._call += 1
            self._in_flight = True
            return loss
        finally:
            if self._corrector is not None:
                self._corrector.restore()  # no-op after a normal step; a failed one keeps true weights
            self._training = False
            self._batch_index += 1
            while self._timeline and self._timeline[0]["step"] <= self._batch_index - 1 - self._timeline_steps:
                self._timeline.popleft()

    # ------------------------------------------------------------------ continuous schedules
    def drain(self) -> bool:
        """Complete every batch still in flight (continuous schedules: the last backwards and
        updates of the last ``train_batch``), so that every micro-batch read is applied exactly
        once; call it on every rank at the end of training. The math does not depend on where
        drains happen (a batch's weight versions are declared), so training may continue
        afterwards: the next call fills the pipeline again. For ``hippie``/``hippie-1f1b`` it
        applies the buffered gradient (``flush_deferred_update``). True if anything was done."""
        if not self._continuous:
            return self.flush_deferred_update()
        if not self._in_flight:
            return False
        self._training = True
        self._op_call = self._call  # drain ops' batches are relative to the call that would come next
        try:
            self._exec_steps(self._declared.drain_steps)
        finally:
            self._training = False
        self._first_batch = self._call
        self._in_flight = False
        return True

    def has_in_flight(self) -> bool:
        """True when batches of a continuous schedule are still in flight (``drain()`` has work)."""
        return self._in_flight

    def eval_batch(self, *args, **kwargs):
        # Evaluation reuses the pipeline buffers: finish the batches in flight first.
        self.drain() if self._continuous else None
        return super().eval_batch(*args, **kwargs)

    def _abs_version(self, op) -> int:
        """Absolute weight version of an op (versions below 0 are the initial weights)."""
        return max(0, (self._op_call + op.batch) * self._wv_updates + op.version)

    def _version_params(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _use_version(self, version: int, predicted: bool = False) -> None:
        """Make the module's parameters hold ``version`` (its prediction W + c * delta when
        ``predicted`` and a delta is known), keeping the true values of the one they hold."""
        delta = self._wv_deltas.get(version) if predicted and self._wv_deltas is not None else None
        predicted = delta is not None
        if version == self._wv_loaded and predicted == self._wv_predicted:
            return
        params = self._version_params()
        data = [p.data for p in params]
        loaded = self._wv_loaded
        if (not self._wv_predicted and (loaded == self._wv_count or loaded in self._wv_stashed)
                and loaded not in self._wv_store):
            self._wv_store[loaded] = _flatten_dense_tensors(data)
        if version not in self._wv_store:
            raise RuntimeError(f"stage {self.stage_id}: weight version {version} is not available (current "
                               f"{self._wv_count}, stashed {sorted(self._wv_stashed)}); the validator should "
                               "have rejected this schedule")
        # a prediction leaves the true values in the store; the true version moves into the module
        values = self._wv_store[version] + self._wv_coefficient * delta if predicted else self._wv_store.pop(version)
        for dst, src in zip(data, _unflatten_dense_tensors(values, data)):
            dst.copy_(src)
        self._wv_loaded, self._wv_predicted = version, predicted

    def _exec_stash_weights(self):
        op = self._current_op
        version = self._abs_version(op)
        if version != self._wv_count:
            raise RuntimeError(f"stage {self.stage_id}: stash_weights of version {version}, current is "
                               f"{self._wv_count}")
        self._use_version(version)
        if version not in self._wv_store:
            self._wv_store[version] = _flatten_dense_tensors([p.data for p in self._version_params()])
        self._wv_stashed.add(version)
        self._wv_peak = max(self._wv_peak, len(self._wv_stashed) + 1)

    def _exec_free_weights(self):
        op = self._current_op
        version = (self._op_call + op.batch) * self._wv_updates + op.version
        if version < 0:
            return  # the initial weights are freed as version 0
        self._wv_stashed.discard(version)
        self._wv_store.pop(version, None)
        self._prune_deltas()

    def _prune_deltas(self):
        """Keep the deltas of the versions compute may still use (current and stashed)."""
        for v in [v for v in self._wv_deltas or () if v != self._wv_count and v not in self._wv_stashed]:
            del self._wv_deltas[v]

    def weight_versions(self) -> dict:
        """This stage's weight versions: current (updates applied), stashed, the most held at once."""
        return {"current": self._wv_count, "stashed": sorted(self._wv_stashed), "peak": self._wv_peak}

    def _continuous_step(self):
        """A per-stage update of a continuous schedule: on the current version, per-stage clipping,
        no step counters (the call advances them); the new values become the current version."""
        if self._versioned:
            self._use_version(self._wv_count)
        params = self._version_params()
        versions = tuple(p._version for p in params)
        before = None if self._wv_deltas is None else _flatten_dense_tensors([p.data for p in params])
        self._stage_step_without_counters()
        if before is not None:  # this update's delta: the next version's prediction
            self._wv_deltas[self._wv_count + 1] = _flatten_dense_tensors([p.data for p in params]).sub_(before)
        if self._versioned:
            # Saved tensors of forwards still awaiting their backward refer to these parameters;
            # the version swap gives each backward its forward's values (see the module docstring).
            torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
        self._wv_count += 1
        self._wv_loaded = self._wv_count
        self._prune_deltas()

    def write_timeline(self, path: str | None = None) -> str | None:
        """Write this rank's executed-instruction timeline (JSON) of the last ``timeline_steps``
        train_batch calls; returns the path."""
        if self._timeline_dir is None and path is None:
            return None
        path = path or os.path.join(self._timeline_dir, f"rank{self.global_rank}.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"rank": self.global_rank, "stage": self.stage_id, "data_parallel_id": self.grid.data_parallel_id,
                       "schedule": self.compiled_schedule.name, "t0_unix": self._t0_unix,
                       "steps_kept": self._timeline_steps, "events": list(self._timeline)}, f)
        return path

    # ------------------------------------------------------------------ per-buffer slots
    def _exec_forward_pass(self, buffer_id):
        super()._exec_forward_pass(buffer_id)
        if self.is_last_stage():
            self._losses[buffer_id] = self.loss

    def _exec_backward_pass(self, buffer_id):
        if self.is_last_stage():
            self.loss = self._losses.pop(buffer_id)
        op = self._current_op
        if self._delayed_params and self._synced_params and op is not None and \
                op.micro_batch == self._last_backward_mb:
            self._early_pending = {id(p) for p in self._synced_params}  # armed for this backward
        try:
            super()._exec_backward_pass(buffer_id)
        finally:
            self._early_pending = None  # unused parameters: the declared start_allreduce starts it

    def _on_grad_final(self, param):
        """Post-accumulate-grad hook of a partially deferred stage's synchronous parameters."""
        if self._early_pending is None:
            return
        self._early_pending.discard(id(param))
        if not self._early_pending:
            self._early_pending = None
            if self._timeline_dir is not None and self._training:
                self._inflight["grads"] = time.perf_counter()
            self._exec_start_allreduce("grads")

    def _exec_forward_backward_pass(self, buffer_id):
        self._exec_forward_pass(buffer_id)
        self._exec_backward_pass(buffer_id)
        # The loss stage is done with this micro-batch: drop its output before the next one.
        self.pipe_buffers["outputs"][buffer_id] = None

    # ------------------------------------------------------------------ non-blocking sends
    def _isend(self, tensor, stage):
        # Keep the tensor with its work handle: the buffer slot may be reused before completion.
        work = dist.isend(tensor, self.grid.stage_to_global(stage))
        self._pending_sends.append((work, tensor))

    def _exec_isend_activations(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.has_attention_mask or self.has_bool_tensors:
            outputs = tuple(outputs[:-1]) + (outputs[-1].half(), )
        if self.dynamic_shape or self.first_output_send:
            self.first_output_send = False
            self._send_tensor_meta(outputs, self.next_stage)
        for tensor in (outputs, ) if torch.is_tensor(outputs) else outputs:
            self._isend(tensor, self.next_stage)

    def _exec_isend_grads(self, buffer_id):
        inputs = self.pipe_buffers["inputs"][buffer_id]
        if self.has_attention_mask or self.has_bool_tensors:
            inputs = tuple(inputs[:-1])
        for tensor in (inputs, ) if torch.is_tensor(inputs) else inputs:
            if tensor.is_floating_point():
                assert tensor.grad is not None
                self._isend(tensor.grad, self.prev_stage)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_wait_sends(self):
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []

    # ------------------------------------------------------------------ gradients
    def _stage_grads(self) -> list[torch.Tensor]:
        """This stage's accumulated (fp32) gradients, materialised as zeros where missing."""
        if self.using_bf16_optimizer:
            grads, _ = self.optimizer.get_grads_for_reduction()
            return list(grads)
        grads = []
        for p in self.module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        return grads

    @staticmethod
    def _grads_of(params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The (fp32) gradients of ``params``, materialised as zeros where missing."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in params]

    def _synced_grads(self) -> list[torch.Tensor]:
        """The gradients this step's all-reduce covers: the whole stage, or none of a deferred
        stage but its undelayed part (partial deferral)."""
        return self._stage_grads() if not self._delayed_params else self._grads_of(self._synced_params)

    def _delayed_grads(self) -> list[torch.Tensor]:
        """The gradients a deferred stage buffers and applies one step late."""
        return self._stage_grads() if not self._synced_params else self._grads_of(self._delayed_params)

    def _start_allreduce(self, flat: torch.Tensor):
        flat.div_(self.dp_world_size)
        return dist.all_reduce(flat, group=self.grid.get_data_parallel_group(), async_op=True)

    def _exec_start_allreduce(self, target):
        if target == "grads":
            if self._allreduce["grads"] is not None:
                return  # started early, inside the last backward (_on_grad_final)
            grads = self._synced_grads()
            if not grads:  # a wholly deferred stage: everything waits for the buffer
                self._allreduce["grads"] = (None, None, grads)
                return
            flat = _flatten_dense_tensors(grads)
            work = self._start_allreduce(flat) if self.is_data_parallel else None
            self._allreduce["grads"] = (work, flat, grads)
        elif self._grad_buffer_state == "filled":
            if self.is_data_parallel:
                self._allreduce["buffer"] = (self._start_allreduce(self._grad_buffer), None, None)
                self._grad_buffer_state = "reducing"
            else:
                self._grad_buffer_state = "reduced"

    def _exec_wait_allreduce(self, target):
        if target == "grads":
            work, flat, grads = self._allreduce["grads"]
            if work is not None:
                work.wait()
                for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    grad.copy_(reduced)
            self._allreduce["grads"] = None
        else:
            self._wait_buffer()

    def _wait_buffer(self):
        if self._grad_buffer_state == "reducing":
            self._allreduce["buffer"][0].wait()
            self._allreduce["buffer"] = None
            self._grad_buffer_state = "reduced"

    def _exec_copy_grads_to_buffer(self):
        grads = self._delayed_grads()
        flat = _flatten_dense_tensors(grads)
        if self._grad_buffer is None:
            self._grad_buffer = flat
        else:
            self._grad_buffer.copy_(flat)
        for g in grads:
            g.zero_()
        self._grad_buffer_state = "filled"

    def _exec_apply_buffered_update(self):
        if self._corrector is not None:
            self._corrector.restore()  # the update applies to the true weights, not the predicted ones
        if self._grad_buffer_state != "reduced" and not self._synced_params:
            # First step: nothing buffered yet. Keep step counters and the LR schedule in
            # lock-step with the other stages (checkpoint tags use global_steps).
            self._stage_step(apply=False)
            return
        grads = self._delayed_grads()
        current = _flatten_dense_tensors(grads)  # this step's delayed gradient, buffered right after
        if self._grad_buffer_state == "reduced":
            for g, buffered in zip(grads, _unflatten_dense_tensors(self._grad_buffer, grads)):
                g.copy_(buffered)
        else:  # partial deferral, first step: the synchronous part updates, the delayed part has nothing yet
            for p in self._delayed_params:
                p.grad = None  # the optimizer skips it
        self._stage_step(apply=True)
        self._grad_buffer_state = "empty"
        grads = self._delayed_grads()
        for g, cur in zip(grads, _unflatten_dense_tensors(current, grads)):
            g.copy_(cur)

    def _exec_stage_optimizer_step(self):
        if self._continuous:
            self._continuous_step()
        else:
            self._stage_step(apply=True)

    def _stage_step(self, apply: bool):
        """DeepSpeed's ``_take_model_step`` with the gradient norm reduced over this stage only."""
        if not apply:
            self._step_bookkeeping()
            return
        saved = getattr(self.optimizer, "mpu", None)
        local = _StageLocalMPU(self.mpu, self.grid)
        mpu = self.mpu
        try:
            self.mpu = local
            if hasattr(self.optimizer, "mpu"):
                self.optimizer.mpu = local
            self._force_grad_boundary = True
            self._take_model_step(None)
        finally:
            self._force_grad_boundary = False
            self.mpu = mpu
            if hasattr(self.optimizer, "mpu"):
                self.optimizer.mpu = saved

    def _stage_step_without_counters(self):
        """A per-stage optimizer step that leaves the LR schedule, ``global_steps`` and
        ``global_samples`` as they were (updates outside the once-per-call bookkeeping)."""
        lr_scheduler, steps, samples = self.lr_scheduler, self.global_steps, self.global_samples
        self.lr_scheduler = None
        try:
            self._stage_step(apply=True)
        finally:
            self.lr_scheduler, self.global_steps, self.global_samples = lr_scheduler, steps, samples

    def _step_bookkeeping(self):
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    # ------------------------------------------------------------------ deferred state
    def has_pending_update(self) -> bool:
        """True when this stage holds a buffered gradient not yet applied."""
        return self._grad_buffer_state != "empty"

    def flush_deferred_update(self):
        """Apply the buffered gradient of the last step now (call once at the end of training
        on every rank: its all-reduce is a collective of the stage's data-parallel group).
        Step counters and the LR schedule do not advance."""
        if self._continuous:  # 2bw / pipedream: what is pending is the batches in flight
            return self.drain()
        if self._grad_buffer_state == "empty":
            return False
        if self._grad_buffer_state == "filled":
            self._exec_start_allreduce("buffer")
        self._wait_buffer()
        grads = self._delayed_grads()
        for g, buffered in zip(grads, _unflatten_dense_tensors(self._grad_buffer, grads)):
            g.copy_(buffered)
        for p in self._synced_params:
            p.grad = None  # applied in their own step already
        self._stage_step_without_counters()
        self._grad_buffer_state = "empty"
        return True

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        # Continuous schedules: drain the batches in flight first (activations cannot be saved;
        # the math does not depend on the drain), then save the weight versions still needed.
        # In-flight state is wrapped so that stock DeepSpeed refuses it (hippie_ds.checkpoint_state).
        state = dict(client_state)
        state[ckpt.LAYOUT_KEY] = ckpt.layout(self.module.parts)
        if self._continuous:
            self.drain()
            if self._versioned:
                self._use_version(self._wv_count)  # the module's states are the current version
            versions = {"call": self._call, "count": self._wv_count,
                        "stashed": {v: self._wv_store[v].clone() for v in sorted(self._wv_stashed)}}
            state[WEIGHT_VERSIONS_KEY] = ckpt.InFlightState(versions) if versions["stashed"] else versions
        # The pending gradient is part of the training state: finish its all-reduce (identical on
        # every replica afterwards) and save it with this stage's model states.
        self._exec_wait_sends()
        if self._grad_buffer_state == "filled":  # each replica holds its own part: reduce it now
            self._exec_start_allreduce("buffer")
        self._wait_buffer()
        empty = self._grad_buffer_state == "empty" or self._grad_buffer is None  # a spare buffer is not state
        buffer = {"state": self._grad_buffer_state, "buffer": None if empty else self._grad_buffer.clone()}
        state[GRAD_BUFFER_KEY] = buffer if self._grad_buffer_state == "empty" else ckpt.InFlightState(buffer)
        if self._corrector is not None:
            state[WEIGHT_PREDICTION_KEY] = self._corrector.state_dict()
        if self._wv_deltas is not None:  # drained above: the module holds the true current version
            state[WEIGHT_PREDICTION_KEY] = {"deltas": {v: d.clone() for v, d in self._wv_deltas.items()}}
        return super().save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, **kwargs):
        """DeepSpeed's ``load_checkpoint``, plus hippie-ds's state. Loads checkpoints of stock
        DeepSpeed and of other stage layouts (re-planned runs): weights follow by layer; optimizer
        state cannot, so a layout change needs ``load_optimizer_states=False`` (an explicit
        restart of the optimizer state) and a checkpoint with nothing in flight."""
        self._wait_buffer()
        changed, why = self._checkpoint_layout_change(load_dir, tag)
        if changed and load_optimizer_states:
            raise ValueError(f"load_checkpoint({str(load_dir)!r}): {why}")
        with ckpt.loading():
            path, client_state = super().load_checkpoint(load_dir, tag=tag,
                                                         load_optimizer_states=load_optimizer_states, **kwargs)
        if client_state is None:
            return path, client_state
        client_state.pop(ckpt.LAYOUT_KEY, None)
        buffer = ckpt.unwrap(client_state.pop(GRAD_BUFFER_KEY, None))
        versions = ckpt.unwrap(client_state.pop(WEIGHT_VERSIONS_KEY, None))
        prediction = client_state.pop(WEIGHT_PREDICTION_KEY, None)
        if changed:
            if (buffer and buffer["state"] != "empty") or (versions and versions["stashed"]):
                raise ValueError(f"load_checkpoint({str(load_dir)!r}): the checkpoint holds in-flight state (a deferred "
                                 "gradient or weight versions) of another stage layout; save it after engine.drain() "
                                 "to resume with new stage boundaries")
            prediction = None  # the previous weights of other stages: the prediction restarts
        if buffer is not None and buffer["buffer"] is not None:
            delayed = sum(p.numel() for p in self._delayed_params)
            if buffer["buffer"].numel() != delayed:
                raise ValueError(f"load_checkpoint({str(load_dir)!r}): stage {self.stage_id}'s buffered gradient has "
                                 f"{buffer['buffer'].numel()} elements, this run delays {delayed} (config key "
                                 '"hippie.deferred_layers" differs from the saved run\'s); resume with the same '
                                 "value, or save after engine.drain()")
        if buffer is not None:
            self._grad_buffer_state = buffer["state"]
            # an empty buffer is re-allocated at this layout's size on first use
            self._grad_buffer = None if buffer["buffer"] is None else buffer["buffer"].to(self.device)
        if prediction is not None and self._corrector is not None and "deltas" not in prediction:
            self._corrector.load_state_dict(prediction, self.device)
        if self._wv_deltas is not None:
            deltas = (prediction or {}).get("deltas", {})
            self._wv_deltas = {int(v): d.to(self.device) for v, d in deltas.items()}
        if versions is not None:
            self._call = self._op_call = self._first_batch = versions["call"]
            self._in_flight = False
            self._wv_count = self._wv_loaded = versions["count"]
            self._wv_predicted = False
            self._wv_store = {int(v): t.to(self.device) for v, t in versions["stashed"].items()}
            self._wv_stashed = set(self._wv_store)
        return path, client_state

    def _checkpoint_layout_change(self, load_dir, tag) -> tuple[bool, str]:
        """Whether the checkpoint's stage layout differs from this model's, and the message."""
        import glob
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                return False, ""  # DeepSpeed warns and loads nothing
            with open(latest) as f:
                tag = f.read().strip()
        files = sorted(glob.glob(os.path.join(load_dir, str(tag), "mp_rank_*_model_states.pt")))
        if not files:
            return False, ""
        own = os.path.join(load_dir, str(tag), f"mp_rank_{self.stage_id:02d}_model_states.pt")
        with ckpt.loading():
            saved = torch.load(own if os.path.exists(own) else files[0], map_location="cpu", weights_only=False)
        current = ckpt.layout(self.module.parts)
        saved_layout = saved.get(ckpt.LAYOUT_KEY)
        shapes_match = True
        if saved_layout is None and os.path.exists(own) and isinstance(saved.get("optimizer"), dict):
            states = saved["optimizer"].get("state", {})
            params = self._version_params()
            shapes_match = all(not torch.is_tensor(t) or t.dim() == 0 or (int(i) < len(params) and
                                                                          t.shape == params[int(i)].shape)
                               for i, st in states.items() for t in st.values())
        changed = ckpt.layout_changed(saved_layout, current, len(files), shapes_match)
        return changed, ckpt.layout_change_message(saved_layout, current, len(files)) if changed else ""

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        hs.ForwardBackwardPass: _exec_forward_backward_pass,
        hs.ISendActivation: _exec_isend_activations,
        hs.ISendGrad: _exec_isend_grads,
        hs.WaitSends: _exec_wait_sends,
        hs.StartAllReduce: _exec_start_allreduce,
        hs.WaitAllReduce: _exec_wait_allreduce,
        hs.CopyGradsToBuffer: _exec_copy_grads_to_buffer,
        hs.ApplyBufferedUpdate: _exec_apply_buffered_update,
        hs.StageOptimizerStep: _exec_stage_optimizer_step,
        hs.StashWeights: _exec_stash_weights,
        hs.FreeWeights: _exec_free_weights,
    }
