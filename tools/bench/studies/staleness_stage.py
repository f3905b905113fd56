"""One pipeline stage of the staleness study (``tools/bench.py staleness``, studies/staleness.py):
its parameters, AdamW and LR schedule, applying its gradient synchronously or one step late, with
the rule's correction (weight extrapolation, PipeOptim's predicted step, error feedback, DC-ASGD,
beta1 or learning-rate changes). The corrections are explained in the study's docstring."""

from __future__ import annotations

import math
import time


class Stage:
    """One stage's parameters, AdamW and LR schedule, synchronous or one step late, with the
    rule's correction. Per step: ``before_compute`` (weights the forward/backward uses),
    ``after_backward`` (restore, update), ``end_step`` (LR schedule); ``flush`` at the end."""

    def __init__(
        self,
        params,
        delayed: bool,
        methods: dict,
        lr: float,
        steps: int,
        muon: set | None = None,
        muon_lr: float = 0.02,
    ):
        import torch
        from hippie_ds.adapter.ds.runtime import warmup_decay_lr

        self.torch = torch
        self.params = params
        self.delayed = delayed
        self.methods = methods if delayed else {}
        beta1 = self.methods.get("beta1", 0.9)
        scale = self.methods.get("lrscale", 1.0)
        peak = lr * scale
        if muon is None and "nadam" in self.methods:
            # the Nesterov method's recipe (Ajanthan et al. 2025; PluralisResearch/AsyncPP run.bash:
            # --optimizer nadamw --momentum 0.99): NAdam with decoupled weight decay, beta1 = B
            self.opt = torch.optim.NAdam(
                params, lr=peak, weight_decay=0.01, betas=(self.methods["nadam"], 0.999), decoupled_weight_decay=True
            )
            peaks = peak
        elif muon is None:
            # DeepSpeed "AdamW" with torch_adam: torch.optim.AdamW(lr, weight_decay=0.01), default betas/eps
            self.opt = torch.optim.AdamW(params, lr=peak, weight_decay=0.01, betas=(beta1, 0.999))
            peaks = peak
        else:
            self.opt, peaks = self._muon(params, muon, muon_lr * scale, peak, beta1)
        self.sched = warmup_decay_lr(
            self.opt,
            total_num_steps=steps,
            warmup_min_lr=0.0,
            warmup_max_lr=peaks,
            warmup_num_steps=max(1, steps // 20),
            warmup_type="linear",
        )
        self.pending = None  # the delayed gradient
        self.saved = None  # the true weights while the parameters hold the predicted ones
        self.previous = None  # extrapolate: W(t-1); dcasgd: the weights the pending gradient was computed on
        self.computed_on = None
        self.last_update = None  # ef: u(t-1)
        self.correction_seconds = 0.0
        self.dc_ratio = []  # dcasgd: |correction| / |g| per step

    def _muon(self, params, muon: set, muon_lr: float, adam_lr: float, beta1: float):
        """DeepSpeed's "Muon" optimizer (MuonWithAuxAdam, torch's AdamW for the rest): Muon (momentum
        0.95, Newton-Schulz) on the parameters whose ids are in ``muon``, AdamW on the others; weight
        decay 0.01 on both. Returns it and the per-group peak learning rates."""
        from hippie_ds.adapter.ds.runtime import muon_with_aux_adam

        torch = self.torch
        groups = [
            dict(
                params=[p for p in params if id(p) in muon],
                use_muon=True,
                lr=muon_lr,
                momentum=0.95,
                weight_decay=0.01,
                ns_method="gram",
            ),
            dict(
                params=[p for p in params if id(p) not in muon],
                use_muon=False,
                lr=adam_lr,
                betas=(beta1, 0.999),
                eps=1e-8,
                weight_decay=0.01,
            ),
        ]
        groups = [g for g in groups if g["params"]]
        opt = muon_with_aux_adam(groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={"lr": adam_lr})
        return opt, [g["lr"] for g in groups]

    # weights used by the forward/backward
    def before_compute(self):
        if not self.delayed:
            return
        if "weights" in self.methods:
            return self._stale_weights()
        torch = self.torch
        start = time.perf_counter()
        with torch.no_grad():
            if "extrapolate" in self.methods:
                c = self.methods["extrapolate"]
                if self.previous is None:
                    self.previous = [p.detach().clone() for p in self.params]
                self.saved = [p.detach().clone() for p in self.params]
                for p, q in zip(self.params, self.previous):
                    delta = p - q
                    q.copy_(p)  # W(t) becomes the next step's W(t-1)
                    p.add_(delta, alpha=c)
            elif "pipeoptim" in self.methods:
                s = self.methods["pipeoptim"]
                self.saved = [p.detach().clone() for p in self.params]
                group = self.opt.param_groups[0]
                lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
                for p in self.params:
                    state = self.opt.state.get(p)
                    if not state or float(state["step"]) == 0:
                        continue
                    k = float(state["step"])
                    m_hat = state["exp_avg"] / (1 - b1**k)
                    denom = (state["exp_avg_sq"] / (1 - b2**k)).sqrt_().add_(eps)
                    p.sub_(s * lr * (m_hat / denom + wd * p))
            if "dcasgd" in self.methods:
                self.computed_on = [p.detach().clone() for p in self.params]
        self.correction_seconds += time.perf_counter() - start

    def _stale_weights(self):
        """2bw's pairing (``weights``): step t computes on W(t-1) (W(0) while t < 2), predicted as
        W(t-1) + c (W(t-1) - W(t-2)) with ``extrapolate`` once t - 1 >= 1, and its own gradient
        updates W(t) at once (after_backward)."""
        torch = self.torch
        start = time.perf_counter()
        with torch.no_grad():
            current = [p.detach().clone() for p in self.params]
            history = getattr(self, "history", [])
            compute = history[-1] if history else current
            if "extrapolate" in self.methods and len(history) >= 2:
                c = self.methods["extrapolate"]
                compute = [w + c * (w - q) for w, q in zip(history[-1], history[-2])]
            for p, w in zip(self.params, compute):
                p.copy_(w)
            self.saved = current
            self.history = (history + [current])[-2:]
            if "dcasgd" in self.methods:
                self.computed_on = [w.clone() for w in compute]
        self.correction_seconds += time.perf_counter() - start

    def after_backward(self):
        torch = self.torch
        if not self.delayed:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        if "weights" in self.methods:  # the update applies now, to W(t)
            with torch.no_grad():
                for p, w in zip(self.params, self.saved):
                    p.copy_(w)
            self.saved = None
            grads = [p.grad.detach().clone() for p in self.params]
            self._apply(grads, self.computed_on)
            self.opt.zero_grad(set_to_none=True)
            return
        start = time.perf_counter()
        with torch.no_grad():
            if self.saved is not None:  # the update applies to the true weights
                for p, w in zip(self.params, self.saved):
                    p.copy_(w)
                self.saved = None
        self.correction_seconds += time.perf_counter() - start
        current = [p.grad.detach().clone() for p in self.params]
        bak = self.previous_compute
        self.previous_compute = self.computed_on
        if self.pending is not None:
            self._apply(self.pending, bak)
        self.pending = current
        self.opt.zero_grad(set_to_none=True)

    previous_compute = None

    def _apply(self, grads, computed_on):
        torch = self.torch
        start = time.perf_counter()
        with torch.no_grad():
            if "dcasgd" in self.methods and computed_on is not None:
                lam = self.methods["dcasgd"]
                group = self.opt.param_groups[0]
                (_, b2), eps = group["betas"], group["eps"]
                num = den = 0.0
                corrected = []
                for p, g, w in zip(self.params, grads, computed_on):
                    state = self.opt.state.get(p)
                    if not state or float(state["step"]) == 0:
                        corrected.append(g)
                        continue
                    v_hat = state["exp_avg_sq"] / (1 - b2 ** float(state["step"]))
                    corr = lam * g * g * (p - w) / (v_hat.sqrt() + eps)
                    num += float(corr.square().sum())
                    den += float(g.square().sum())
                    corrected.append(g + corr)
                grads = corrected
                if den > 0:
                    self.dc_ratio.append(math.sqrt(num / den))
            for p, g in zip(self.params, grads):
                p.grad = g.clone()
            before = [p.detach().clone() for p in self.params] if "ef" in self.methods else None
        self.correction_seconds += time.perf_counter() - start
        self.opt.step()
        if before is not None:
            start = time.perf_counter()
            gamma = self.methods["ef"]
            with torch.no_grad():
                update = [b - p for b, p in zip(before, self.params)]  # u(t): W(t) - W(t+1)
                if self.last_update is not None:
                    for p, u, u_prev in zip(self.params, update, self.last_update):
                        p.sub_(u - u_prev, alpha=gamma)
                else:
                    for p, u in zip(self.params, update):
                        p.sub_(u, alpha=gamma)
                self.last_update = update
            self.correction_seconds += time.perf_counter() - start

    def end_step(self):
        self.sched.step()

    def flush(self):
        """Apply the last buffered gradient (the LR schedule does not advance)."""
        if self.delayed and self.pending is not None:
            self._apply(self.pending, self.previous_compute)
            self.pending = None
            self.opt.zero_grad(set_to_none=True)
