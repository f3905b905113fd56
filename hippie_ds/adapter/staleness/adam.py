"""The ``adam`` staleness correction (``hippie.staleness.method: "adam"``): a stage one update
behind computes on the weights its optimizer's next update is predicted to give, read from the
optimizer's own state (PipeOptim / SpecTrain style), instead of repeating the last update
(``extrapolate``, :mod:`hippie_ds.adapter.staleness.prediction`).

The rule. After the update that made W(v) the optimizer holds, per parameter, Adam's moments m and
s (``exp_avg``, ``exp_avg_sq``) and its step count k; its param group the learning rate lr,
betas (b1, b2), eps and weight decay wd. The next update, with the unknown gradient replaced by
the moments' own estimate (the gradient equal to m: the moments do not move), is::

    u_hat(v) = -lr * ( m / (1 - b1^(k+1)) / (sqrt(s) / sqrt(1 - b2^(k+1)) + eps)  + wd * W(v) )

(AdamW, torch.optim.AdamW's decoupled decay; torch.optim.Adam's L2 decay is in the gradient, so
in m: no wd term), and compute runs on ``W_hat(v) = W(v) + c * u_hat(v)`` (c:
``hippie.staleness.coefficient``). lr is the param group's learning rate when the prediction is
made, right after the update (DeepSpeed's LR scheduler sets it per ``train_batch`` call, so it is
the rate of the call in which the next update is made, or one scheduler step before it). A
parameter the optimizer has not stepped yet (no state) is predicted unchanged. The prediction of
W(0) is W(0) (nothing known yet), as ``extrapolate``'s.

Where nothing needs predicting. A stage that makes W(v+1) before its first compute on version v
computes on the made weights instead: ``W(v) + c (W(v+1) - W(v))``, W(v+1) itself at c = 1.
``2bw``'s last stage is such a stage (it updates at the end of a call, and the next call's
micro-batches all compute on the version before), so with ``adam`` it follows the synchronous
rule; on the other stages a micro-batch computes on version v before that update (its backward
must see its forward's weights), so they keep Adam's prediction
(:func:`~hippie_ds.adapter.staleness.prediction.made_before_use` reads it from the compiled schedule).

Where it is computed. fp32 (no ZeRO): the optimizer steps the module's parameters, each rank holds
every moment of its stage, and computes ``W_hat`` locally. bf16 and bf16 + ZeRO-1
(``BF16_Optimizer``): the fp32 master weights and the moments are partitioned over the stage's
data-parallel group; each rank computes ``bf16(W_master + c * u_hat)`` on its partition, and the
all-gather DeepSpeed makes after every step to give each rank the new bf16 weights carries the
predicted partition beside the weights' (one all-gather of twice the bytes instead of DeepSpeed's
own; no extra collective). ZeRO-1 as written (``DeepSpeedZeroOptimizer``) and optimizers that are
not torch.optim.Adam / AdamW are refused at start-up (:func:`check_config`, before any process group).

Memory per corrected parameter: the predicted weights replace ``extrapolate``'s delta (fp32: 4
bytes, bf16: 2 bytes per version kept: one for hippie's delayed layers, up to two for 2bw), plus
under ``BF16_Optimizer`` a bf16 copy of the whole stage's predicted weights (2 bytes per parameter
of the stage) and, during the all-gather, its send and receive buffers (2 x 2 bytes per parameter
of the partition, and of the stage).
"""

from __future__ import annotations

import math

import torch

from ...config import ConfigError
from .prediction import InPlacePrediction, MadeWeightsPrediction

METHOD = "adam"
ALLOWED = "torch.optim.AdamW or torch.optim.Adam (DeepSpeed's \"AdamW\"/\"Adam\" with \"torch_adam\": true)"


def _refuse(what: str) -> ConfigError:
    return ConfigError(
        f'config key "hippie.staleness.method" = "{METHOD}": {what}; allowed with the optimizers '
        f'{ALLOWED} (fp32, or bf16 / bf16 + ZeRO-1 on BF16_Optimizer); other optimizers take '
        f'"extrapolate-made" (the default), "extrapolate" or "none"'
    )


def _adam_kind(optimizer) -> str:
    """'adamw' (decoupled decay) or 'adam' (L2 decay in the gradient); refuses anything else."""
    if type(optimizer) is torch.optim.AdamW:
        kind = "adamw"
    elif type(optimizer) is torch.optim.Adam:
        kind = "adamw" if optimizer.defaults.get("decoupled_weight_decay") else "adam"
    else:
        raise _refuse(f"the optimizer is {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(key):
                raise _refuse(f'the optimizer runs with {key}=True')
    return kind


@torch.no_grad()
def predicted_update(
    optimizer, kind: str, param: torch.Tensor, weights: torch.Tensor, group: dict
) -> torch.Tensor | None:
    """u_hat for ``param`` (a tensor the optimizer steps) at ``weights`` (its fp32 values), or
    None when the optimizer has no state for it yet (module docstring)."""
    state = optimizer.state.get(param)
    if not state or "exp_avg" not in state:
        return None
    k = float(state["step"]) + 1.0
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    lr, eps = float(lr), float(eps)
    denom = state["exp_avg_sq"].sqrt().div_(math.sqrt(1.0 - b2**k)).add_(eps)
    update = torch.div(state["exp_avg"], denom).mul_(-lr / (1.0 - b1**k))
    if kind == "adamw" and wd != 0:
        update.add_(weights, alpha=-lr * wd)
    return update


class _Fp32Source:
    """fp32: the optimizer steps the module's parameters themselves."""

    def install(self) -> None:
        pass

    def __init__(self, optimizer, kind: str, coefficient: float):
        self.optimizer, self.kind, self.coefficient = optimizer, kind, coefficient
        self.groups = {id(q): g for g in optimizer.param_groups for q in g["params"]}

    @torch.no_grad()
    def predicted(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for param in params:
            group, weights = self.groups.get(id(param)), torch.Tensor.detach(param)
            u = None if group is None else predicted_update(self.optimizer, self.kind, param, weights, group)
            out.append(torch.clone(weights) if u is None else torch.add(weights, u, alpha=self.coefficient))
        return out


class _Bf16Source:
    """BF16_Optimizer (bf16, bf16 + ZeRO-1): each rank predicts its partition of the fp32 masters;
    DeepSpeed's post-step all-gather of the bf16 weights carries the predicted partitions too."""

    def __init__(self, bf16_optimizer, kind: str, coefficient: float):
        self.outer, self.kind, self.coefficient = bf16_optimizer, kind, coefficient
        self.inner = bf16_optimizer.optimizer
        # the predicted bf16 weights of every group, laid out as bf16_groups_flat (None: not yet)
        self.flats: list[torch.Tensor | None] = [None] * len(bf16_optimizer.bf16_groups_flat)
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (group, offset in the flat)
        for i, (group, flat) in enumerate(zip(bf16_optimizer.bf16_groups, bf16_optimizer.bf16_groups_flat)):
            for param in group:
                self.where[id(param)] = (
                    i,
                    (torch.Tensor.data_ptr(param) - flat.data_ptr()) // torch.Tensor.element_size(param),
                )

    def install(self) -> None:
        """Only on a stage that predicts (the others keep DeepSpeed's all-gather as it is)."""
        self.outer.update_lp_params = self.update_lp_params  # the instance's; DeepSpeed's step calls it

    @torch.no_grad()
    def _predicted_partition(self, i: int) -> torch.Tensor:
        master = self.outer.fp32_groups_flat_partition[i]
        u = predicted_update(self.inner, self.kind, master, master.detach(), self.inner.param_groups[i])
        return master.detach() if u is None else torch.add(master.detach(), u, alpha=self.coefficient)

    @torch.no_grad()
    def update_lp_params(self):
        """DeepSpeed's BF16_Optimizer.update_lp_params (each rank's fp32 partition into the bf16
        weights, then one all-gather per group over the data-parallel group), gathering the
        predicted partition in the same all-gather."""
        from deepspeed import comm as dist
        from ..ds.zero import dp_group_of

        opt = self.outer
        for i, (parts, master) in enumerate(zip(opt.bf16_partitioned_groups, opt.fp32_groups_flat_partition)):
            group = dp_group_of(opt, i)
            rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
            flat = opt.bf16_groups_flat[i]
            if self.flats[i] is None:
                self.flats[i] = torch.empty_like(flat)
            n = parts[rank].numel()
            parts[rank].data.copy_(master.data)
            predicted = self._predicted_partition(i)
            if world == 1:
                self.flats[i].narrow(0, 0, n).copy_(predicted)
                continue
            send = torch.empty(2 * n, dtype=flat.dtype, device=flat.device)
            send[:n].copy_(parts[rank])
            send[n:].copy_(predicted)
            received = torch.empty(world, 2 * n, dtype=flat.dtype, device=flat.device)
            dist.all_gather(list(received.unbind(0)), send, group=group)
            for r in range(world):
                parts[r].data.copy_(received[r, :n])
                self.flats[i].narrow(0, r * n, n).copy_(received[r, n:])

    @torch.no_grad()
    def predicted(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for param in params:
            i, offset = self.where[id(param)]
            flat, weights = self.flats[i], torch.Tensor.detach(param)
            out.append(
                torch.clone(weights)
                if flat is None
                else torch.clone(flat.narrow(0, offset, torch.Tensor.numel(weights)).view(weights.shape))
            )
        return out


def source_of(optimizer, coefficient: float):
    """What predicts a stage's weights under ``optimizer`` (DeepSpeed's engine.optimizer)."""
    name = type(optimizer).__name__
    if name == "BF16_Optimizer":
        return _Bf16Source(optimizer, _adam_kind(optimizer.optimizer), coefficient)
    if name in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "FP16_Optimizer", "FP16_UnfusedOptimizer"):
        raise _refuse_wrapper(name)
    return _Fp32Source(optimizer, _adam_kind(optimizer), coefficient)


class AdamVersionPrediction(MadeWeightsPrediction):
    """2bw's stages (per version): W_hat(v) is computed once, right after the update that made
    W(v) (:meth:`record`), and kept while compute may use version v (``deltas`` holds the
    predicted weights, flat, as the version store does).

    On a stage whose schedule makes W(v+1) before its first compute on version v (``made``: its
    updates run in their own batch's call, as 2bw's last stage's do, and the next call's
    micro-batches all compute on the version before), nothing needs predicting: version v
    computes on W(v) + c (W(v+1) - W(v)), the made weights themselves at c = 1. Decided from the
    compiled schedule, not from the order ops happen to run in (a ``drain()`` before a checkpoint
    runs a stage's update early; the rule must not change with it); a version compute has already
    used when the next is made (version 0: batch 0 computes on it) keeps its prediction."""

    method = METHOD

    def __init__(self, coefficient: float):
        super().__init__(coefficient)  # the versions compute has used, and ``made``: MadeWeightsPrediction's
        self.source = None
        self.params: list[torch.Tensor] | None = None

    def bind(self, source, params: list[torch.Tensor], made: bool = False) -> None:
        self.source, self.params, self.made = source, params, made

    @torch.no_grad()
    def predicted(self, version: int, true: list[torch.Tensor]) -> list[torch.Tensor] | None:
        return self.deltas.get(version)

    @torch.no_grad()
    def record(self, version: int, delta: list[torch.Tensor]) -> None:
        """Called right after the update that made W(version), with ``delta`` = W(version) -
        W(version - 1): W_hat(version) from the optimizer, and version - 1 made exact if no compute
        has used it yet (class docstring)."""
        if self.source is None:
            raise RuntimeError('hippie.staleness.method "adam": the prediction was not bound to the optimizer')
        from torch._utils import _flatten_dense_tensors

        if self._may_make(version - 1):
            made = _flatten_dense_tensors([torch.Tensor.detach(param) for param in self.params])
            self.deltas[version - 1] = [
                made if self.coefficient == 1 else torch.add(made, delta[0], alpha=self.coefficient - 1)
            ]
        self.deltas[version] = [_flatten_dense_tensors(self.source.predicted(self.params))]
        self._forget_used_before(version - 1)


class AdamInPlacePrediction(InPlacePrediction):
    """hippie's delayed layers (in place): the buffer holds W_hat between steps (computed at
    :meth:`end_update`, right after the deferred update) and the true W during a step."""

    method = METHOD

    def __init__(self, params: list[torch.Tensor], coefficient: float):
        super().__init__(params, coefficient)
        self.source = None

    def bind(self, source, params=None) -> None:
        self.source = source

    @torch.no_grad()
    def predict(self) -> None:
        """Roughly: ``buffer, params = params, W_hat`` (no-op when already predicted)."""
        self._swap_in(torch.Tensor.copy_)

    @torch.no_grad()
    def end_update(self) -> None:
        """After the optimizer step: the buffer becomes W_hat of the weights just made."""
        if self.source is None:
            raise RuntimeError('hippie.staleness.method "adam": the prediction was not bound to the optimizer')
        for buf, w_hat in zip(self._true, self.source.predicted(self.params)):
            buf.copy_(w_hat)
        self.deltas[0], self._true = self._true, None


def make_adam_prediction(coefficient: float, params: list[torch.Tensor] | None = None):
    """The ``adam`` row of :data:`~hippie_ds.adapter.staleness.methods.METHODS`: its prediction."""
    return AdamVersionPrediction(coefficient) if params is None else AdamInPlacePrediction(params, coefficient)


def check_config(staleness, ds_config: dict, optimizer=None) -> None:
    """At start-up, before any process group, on every rank: refuse an optimizer the ``adam``
    correction cannot read: the client's (an instance), else the one the config names. One a
    callable builds is checked as it is built (:func:`checked_when_built`); the wrapper DeepSpeed
    puts around it by :func:`check_wrapper`."""
    if staleness is None or staleness.method != METHOD:
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        _adam_kind(optimizer)
    elif optimizer is None:
        _check_named(ds_config)


def check_wrapper(staleness, config_class) -> None:
    """At start-up, on every rank: refuse a wrapper whose moments the ``adam`` correction does not
    read (:func:`wrapper_of`), as :func:`source_of` would once DeepSpeed has built it."""
    wrapper = wrapper_of(config_class) if staleness is not None and staleness.method == METHOD else None
    if wrapper is not None:
        raise _refuse_wrapper(wrapper)


def _check_named(ds_config: dict) -> None:
    """The optimizer the config names, which DeepSpeed builds (``torch_adam``: torch's own class, with
    the config's params as keyword arguments)."""
    spec = ds_config.get("optimizer")
    if not isinstance(spec, dict):
        raise _refuse("the config names no optimizer")
    kind, params = str(spec.get("type", "")), spec.get("params") or {}
    if kind.lower() not in ("adam", "adamw"):
        raise _refuse(f'the config\'s "optimizer.type" is {kind!r}')
    if not params.get("torch_adam"):
        raise _refuse(
            f'the config\'s "optimizer.type" {kind!r} without "torch_adam": true builds DeepSpeed\'s own '
            'Adam (FusedAdam / DeepSpeedCPUAdam); set "optimizer.params.torch_adam": true'
        )
    if params.get("amsgrad"):
        raise _refuse('the config\'s optimizer runs with "amsgrad": true')
    for key in ("maximize", "capturable", "differentiable"):
        if params.get(key):
            raise _refuse(f'the optimizer runs with {key}=True')


def wrapper_of(config_class) -> str | None:
    """The wrapper DeepSpeed puts around a torch optimizer under this config, when it is one whose
    moments the correction does not read (:func:`~hippie_ds.adapter.precision.paths.optimizer_path`:
    DeepSpeed picks it from the config alone); None for no wrapper and for BF16_Optimizer. ZeRO stages 2
    and 3 are left to DeepSpeed, whose pipeline engine refuses them first."""
    from ..precision.paths import optimizer_path

    path, stage = optimizer_path(config_class), config_class.zero_optimization_stage
    if path in ("fp32", "bf16") or stage > 1:
        return None
    return "DeepSpeedZeroOptimizer" if stage == 1 else "FP16_UnfusedOptimizer"  # fp16: a torch optimizer unfused


def _refuse_wrapper(name: str) -> ConfigError:
    return _refuse(
        f"DeepSpeed wraps the optimizer in {name} (ZeRO as written, or fp16), whose moments "
        'the correction does not read; for ZeRO-1 use bf16 with "data_types": '
        '{"grad_accum_dtype": "fp32"} (BF16_Optimizer)'
    )


def checked_when_built(staleness, optimizer):
    """``optimizer`` as DeepSpeed takes it; a callable building it (DeepSpeed calls it with the
    parameters, on every rank alike) checked as it builds (:func:`check_config`)."""
    if (
        staleness is None
        or staleness.method != METHOD
        or optimizer is None
        or isinstance(optimizer, torch.optim.Optimizer)
    ):
        return optimizer

    def build(*args, **kwargs):
        built = optimizer(*args, **kwargs)
        _adam_kind(built)
        return built

    return build


def take_inputs(prediction, coefficient: float, inputs) -> None:
    """The ``adam`` row of :data:`~hippie_ds.adapter.staleness.methods.METHODS`: as a stage's
    correction is built, give it the optimizer it reads (refused at start-up where it cannot,
    :func:`check_config`; :func:`source_of` refuses it again, should one come through)."""
    source = source_of(inputs.optimizer, coefficient)
    if isinstance(prediction, AdamInPlacePrediction):  # hippie's delayed layers
        source.install()
        prediction.bind(source)
    elif isinstance(prediction, AdamVersionPrediction):  # 2bw's versions
        source.install()
        prediction.bind(source, inputs.params, inputs.made)
