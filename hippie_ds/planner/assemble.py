"""From the chosen candidate to the plan file: every stage's (every model part's) figures, the
deferred layers as the config counts them, the assumptions the plan rests on. Pure Python."""

from __future__ import annotations

from typing import Sequence

from .evaluate import prediction
from .model import _Candidate, _Estimate, _Model
from .plan_file import Baseline, Candidate, Plan, StagePlan
from .noise import time_spread
from .traits import schedule_traits


def _with_parameters(model: _Model, layers: Sequence[int], count: int) -> int:
    """The layers with parameters among a stage's ``count`` leading ``layers`` (model order):
    what ``hippie.deferred_layers`` counts (hippie_ds/schedules/deferral/)."""
    from ..schedules.deferral import with_parameters

    return with_parameters([model.params[i] > 0 for i in layers], count) or count


def _chunk_plans(model: _Model, cand: _Candidate, est: _Estimate, delayed: dict) -> list[StagePlan]:
    """One entry per model part (virtual stages), in model order: its stage and chunk, its own
    figures (in-flight: its chunk's), the stage's memory."""
    from ..schedules.layout import Layout

    lay, f = cand.lay, cand.b / model.b0
    geometry, deferred, out = Layout(lay.kind, lay.K, lay.v), set(est.deferred), []
    for p, (a, e) in enumerate(zip(lay.parts, lay.parts[1:])):
        s, c = geometry.place(p)
        rec, k = lay.rec[s].chunks[c], lay.rec[s]._k(cand.ks[s])[c]
        p_c = est.in_flight[s][c]
        lead = c == 0 and s in delayed  # the deferred layers lead the stage: its first chunk's
        stage_layers = [i for x, y in lay.chunk_ranges(s) for i in range(x, y)]
        held = model.stage_params(lay.chunk_ranges(s))  # a tied module's copy counts where it is held
        out.append(
            StagePlan(
                stage=s,
                chunk=c,
                first_layer=a,
                end_layer=e,
                checkpointed=rec.layers(k),
                forward=f * sum(model.fwd[a:e]),
                backward=f * sum(model.bwd[a:e]),
                recompute=f * rec.time(k),
                param_bytes=sum(held[i] for i in range(a, e)),
                activation_bytes=f * (model.cuts[e - 1] if e < model.n else 0.0),
                kept_bytes=f * rec.kept(k),
                in_flight=p_c,
                deferred=s in deferred,
                memory=est.memory[s],
                deferred_layers=_with_parameters(model, stage_layers, delayed[s].layers) if lead else None,
                delayed_share=delayed[s].delayed_share if lead else 0.0,
                activation_memory=f * rec.activations(k, p_c),
                working_memory=f * lay.working[s],
            )
        )
    return out


def to_plan(
    model: _Model,
    cand: _Candidate,
    est: _Estimate,
    delayed: dict,
    objective: str,
    memory_cap: float | None,
    baselines: list[Baseline],
    price: float,
    candidates: list[Candidate],
    search: dict,
    job: str | None = None,
    chosen_from: str = "search",
) -> Plan:
    """The plan file of ``cand`` (estimate ``est``, deferred layers ``delayed``) for ``objective``;
    ``job``: the job as it is, described (or why there is none); ``chosen_from``: 'job' when the job
    as it is won."""
    from .objectives import OBJECTIVES, PRICE_SOURCE, priced

    lay, f = cand.lay, cand.b / model.b0
    stages, checkpointed = [], []
    deferred = set(est.deferred)
    for s, (a, e) in enumerate(zip(lay.parts, lay.parts[1:]) if lay.v == 1 else ()):
        rec = lay.rec[s]
        layers = rec.layers(cand.ks[s])
        checkpointed += layers
        kept = rec.kept(cand.ks[s])
        stages.append(
            StagePlan(
                stage=s,
                first_layer=a,
                end_layer=e,
                checkpointed=layers,
                forward=f * lay.fwd[s],
                backward=f * lay.bwd[s],
                recompute=f * rec.time(cand.ks[s]),
                param_bytes=lay.params[s],
                activation_bytes=f * lay.cut_out[s],
                kept_bytes=f * kept,
                in_flight=est.in_flight[s],
                deferred=s in deferred,
                memory=est.memory[s],
                deferred_layers=(_with_parameters(model, range(a, e), delayed[s].layers) if s in delayed else None),
                delayed_share=delayed[s].delayed_share if s in delayed else 0.0,
                activation_memory=f * rec.activations(cand.ks[s], est.in_flight[s]),
                working_memory=f * lay.working[s],
            )
        )
    if lay.v > 1:
        stages = _chunk_plans(model, cand, est, delayed)
        checkpointed = [i for st in stages for i in st.checkpointed]
    params = {"deferred_stages": sorted(deferred)} if schedule_traits(cand.schedule, lay.K, cand.M).defers else {}
    return Plan(
        model=model.profile.model,
        num_layers=model.n,
        fingerprint=model.profile.fingerprint(),
        profile_batch_size=model.b0,
        cluster=model.cluster,
        world_size=model.P,
        global_batch=model.G,
        objective=objective,
        objective_figure=OBJECTIVES[objective].figure,
        job=job,
        chosen_from=chosen_from,
        memory_metric=model.metric,
        memory_cap=memory_cap,
        pipeline_depth=lay.K,
        data_parallel=lay.r,
        micro_batch_size=cand.b,
        micro_batches=cand.M,
        schedule=cand.schedule,
        virtual_stages=lay.v,
        layout=lay.kind,
        schedule_params=params,
        boundaries=list(lay.parts),
        checkpointed_layers=sorted(checkpointed),
        stages=stages,
        prediction=prediction(model, est, objective, model.working_memory(lay, cand.b / model.b0)),
        single_device_throughput=model.single_throughput,
        baselines=baselines,
        search=search,
        candidates=candidates,
        profile_spread=time_spread(model.profile),
        profile_steps=model.profile.steps,
        assumptions={
            "state_factor": model.state_factor,
            "staleness_price": price,
            "staleness_price_source": PRICE_SOURCE,
            "staleness_price_meaning": "steps_factor = 1 + price x stale share of the gradient; "
            + (
                "the deferred layers chosen for the least step x steps_factor "
                "(hippie.staleness_price), ranked by throughput / steps_factor"
                if priced(objective)
                else "recorded, not ranked: the deferred layers are no deeper than "
                "measured free (one layer with parameters a stage), chosen for "
                "the least step, ranked by the raw step"
            ),
            "state_factor_meaning": "training-state bytes per profiled parameter byte (4: fp32 weights, "
            "gradients and two Adam moments; 4.5: bf16 weights, fp32 master, "
            "gradient accumulator and two Adam moments over fp32-sized bytes)",
            "working_memory": "per stage the largest of its layers' (and the loss's) forward+backward "
            "working memory: measured on CUDA, else input + output + parameter bytes",
            "time_scaling": "times and activations linear in the micro-batch size",
            "saved_bytes": "per layer as in the profile (PipeDream profiles: the output activation)",
            "placement": "pipeline inside nodes, data parallelism across nodes",
            "memory_metric": f"{model.metric} per-device peak memory",
            "me_unit": "samples/s per GB",
        },
    )
