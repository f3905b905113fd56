"""The plan file's text summary: the configuration, one line a stage, the plan beside the job as it
is and its baselines (each row with the figure the objective ranks), its runner-ups. Pure Python."""

from __future__ import annotations

from typing import Any, Sequence

from hippie_ds.config import DEFAULT_DEFERRED_LAYERS
from hippie_ds.formatting import table

# a plan_file.Plan and its StagePlan (plan_file imports this module for Plan.summary)
Plan = StagePlan = Any

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:.3g}"


def _short(xs: Sequence[int], limit: int = 40) -> str:
    if len(xs) <= limit:
        return str(list(xs))
    return (
        "["
        + ", ".join(map(str, xs[: limit // 2]))
        + f", ... ({len(xs) - limit} more) ..., "
        + ", ".join(map(str, xs[-limit // 2 :]))
        + "]"
    )


def _ranges(xs: Sequence[int]) -> str:
    if not xs:
        return "-"
    out, start, prev = [], xs[0], xs[0]
    for x in list(xs[1:]) + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def _deferred(st: StagePlan) -> str:
    """A stage's deferral: '-', 'yes', or the layers it delays and their share of its gradient."""
    if not st.deferred:
        return "-"
    if st.deferred_layers is None:
        return f"yes, {DEFAULT_DEFERRED_LAYERS}"  # the config's value; its default unless set
    layers = st.end_layer - st.first_layer
    what = "all" if st.deferred_layers >= layers else f"{st.deferred_layers}/{layers}"
    return f"{what} layers, {st.delayed_share:.0%}"


def format_summary(plan: Plan, max_stage_rows: int = 24) -> str:
    """A readable summary: the configuration, one line a stage (the first and last ones of a deep
    pipeline), and the plan beside its baselines."""
    p = plan.prediction
    lines = [
        f"plan for {plan.model} ({plan.num_layers} layers) on {plan.cluster.describe()}",
        f"objective {plan.objective}{' under ' + _gb(plan.memory_cap) + ' GB' if plan.memory_cap else ''}: "
        f"{plan.pipeline_depth} stage(s) x {plan.data_parallel} data-parallel, schedule {plan.schedule}"
        + (f" ({plan.virtual_stages} chunks per stage, layout {plan.layout})" if plan.virtual_stages > 1 else "")
        + (
            f" deferred_stages={_ranges(plan.schedule_params['deferred_stages']) or 'none'}"
            if "deferred_stages" in plan.schedule_params
            else ""
        )
        + f", global batch {plan.global_batch} = {plan.data_parallel} x {plan.micro_batches} micro-batches of "
        f"{plan.micro_batch_size}",
        f"boundaries {_short(plan.boundaries)}; re-computed layers {_ranges(plan.checkpointed_layers)} "
        f"({len(plan.checkpointed_layers)})",
        "",
    ]
    rows = [
        [
            "stage",
            "layers",
            "fwd ms",
            "bwd ms",
            "recomp ms",
            "params MB",
            "in flight",
            "kept MB/mb",
            "deferred",
            "memory GB",
        ]
    ]
    shown = plan.stages
    if len(shown) > max_stage_rows:
        half = max_stage_rows // 2
        shown = shown[:half] + [None] + shown[-half:]
    for st in shown:
        if st is None:
            rows.append(["...", f"({len(plan.stages) - 2 * half} more)"])
            continue
        rows.append(
            [
                f"{st.stage}.{st.chunk}" if plan.virtual_stages > 1 else str(st.stage),
                f"{st.first_layer}-{st.end_layer - 1}",
                f"{st.forward * 1e3:.4g}",
                f"{st.backward * 1e3:.4g}",
                f"{st.recompute * 1e3:.4g}",
                f"{st.param_bytes / 1e6:.4g}",
                str(st.in_flight),
                f"{st.kept_bytes / 1e6:.4g}",
                _deferred(st),
                _gb(st.memory),
            ]
        )
    lines.append(table(rows[0], rows[1:]))
    lines.append("")
    rows = [
        [
            "",
            "stages x dp",
            "schedule",
            "mb x M",
            "step ms",
            "samples/s",
            "scalability",
            f"mem GB ({plan.memory_metric})",
            "max GB",
            "ME",
            "vs DP ME",
            "fits",
            f"{plan.objective} (ranked)",
        ]
    ]
    dp = next((b.prediction for b in plan.baselines if b.name == "dp" and b.prediction), None)

    def row(name, depth, width, schedule, b, M, pred):
        rel = f"{pred.me / dp.me:.2f}x" if dp and dp.me > 0 else "-"
        ranked = "-" if pred.objective_value is None else f"{pred.objective_value:.4g}"
        return [
            name,
            f"{depth} x {width}",
            schedule,
            f"{b} x {M}",
            f"{pred.step_time * 1e3:.4g}",
            f"{pred.throughput:.4g}",
            f"{pred.scalability:.3f}",
            _gb(pred.memory),
            _gb(pred.memory_max),
            f"{pred.me:.4g}",
            rel,
            "yes" if pred.fits else "NO",
            ranked,
        ]

    rows.append(
        row(
            "plan", plan.pipeline_depth, plan.data_parallel, plan.schedule, plan.micro_batch_size, plan.micro_batches, p
        )
    )
    skipped = []
    for b in plan.baselines:
        if b.prediction is None:
            skipped.append(f"{b.name}: skipped, {b.skipped}")
            continue
        rows.append(
            row(
                b.name, b.pipeline_depth, b.data_parallel, b.schedule, b.micro_batch_size, b.micro_batches, b.prediction
            )
        )
    lines.append(table(rows[0], rows[1:]))
    lines.extend(skipped)
    lines.append(
        f"ME = scalability x throughput / memory (samples/s per GB); single device "
        f"{plan.single_device_throughput:.4g} samples/s; figures by {p.predicted_by}; planned in "
        f"{plan.search.get('seconds', 0):.3g} s"
    )
    if plan.objective_figure:
        lines.append(f"ranked by the {plan.objective} objective: {plan.objective_figure}")
    if p.steps_factor > 1.0:
        how = (
            "candidates were ranked by step x that"
            if plan.ranks_priced
            else "recorded, not ranked (no layer deeper than measured free is delayed)"
        )
        lines.append(
            f"the delayed layers are priced at {p.steps_factor:.3f}x the steps to a loss (staleness_price "
            f"{plan.assumptions.get('staleness_price')}, measured: "
            f"{plan.assumptions.get('staleness_price_source', 'not recorded')}); {how}"
        )
    lines.extend(_job_lines(plan))
    lines.extend(format_candidates(plan))
    return "\n".join(lines)


def within_spread(plan: Plan) -> list[int]:
    """Indices of the plan's candidates whose priced step is within the profile's spread of the plan's."""
    if plan.profile_spread is None:
        return []
    mine = plan.ranked_step(plan.prediction.step_time, plan.prediction.steps_factor)
    return [
        i
        for i, c in enumerate(plan.candidates)
        if mine > 0 and abs(plan.ranked_step(c.step_time, c.steps_factor) / mine - 1) <= plan.profile_spread
    ]


def format_candidates(plan: Plan) -> list[str]:
    """The candidates table beside the plan, and what the profile's spread says of the margins."""
    if not plan.candidates:
        return []
    p = plan.prediction
    mine = plan.ranked_step(p.step_time, p.steps_factor)
    spread = plan.profile_spread
    close = set(within_spread(plan))
    rows = [
        [
            "plan",
            f"{plan.pipeline_depth} x {plan.data_parallel}",
            plan.schedule,
            f"{plan.micro_batch_size} x {plan.micro_batches}",
            _short(plan.boundaries, 12),
            f"{mine * 1e3:.4g}",
            "-",
            "",
        ]
    ]
    for i, c in enumerate(plan.candidates):
        step = plan.ranked_step(c.step_time, c.steps_factor)
        rows.append(
            [
                c.kind,
                f"{c.pipeline_depth} x {c.data_parallel}",
                c.schedule,
                f"{c.micro_batch_size} x {c.micro_batches}",
                _short(c.boundaries, 12),
                f"{step * 1e3:.4g}",
                f"{(step / mine - 1) * 100:+.1f}%" if mine > 0 else "-",
                "within spread" if i in close else "",
            ]
        )
    said = f"the profile's spread {spread:.0%}" if spread is not None else "the profile records no spread"
    lines = [
        "",
        f"candidates beside the plan, by predicted step ({said}; the plan is chosen by the "
        f"{plan.objective} objective):",
        table(["", "stages x dp", "schedule", "mb x M", "boundaries", "step ms", "vs plan", ""], rows),
    ]
    if close:
        lines.append(
            f"the plan's margin over {len(close)} of them is inside the profile's spread ({spread:.0%}): the "
            "profile cannot tell which is fastest; measure them on the job (python -m tools.bench cut-sweep "
            "--plan PLAN --profile PROFILE)"
        )
    from .noise import MIN_MARGIN, separating_steps

    steps, margin = separating_steps(plan)
    if steps is None and plan.profile_spread is not None and margin < MIN_MARGIN:
        lines.append(
            f"the nearest candidate is predicted within {MIN_MARGIN:.1%} of the plan: no profiling length "
            "separates them; only measuring them does (cut-sweep)"
        )
    if steps is not None:
        lines.append(
            f"profiling steps that would separate the plan from its nearest candidate ({margin:.1%} apart): "
            f"{steps} ('hippie': {{'profile': {{'steps': {steps}}}}}; this profile measured "
            f"{plan.profile_steps or 'one pass'})"
        )
    return lines


def _job_lines(plan: Plan) -> list[str]:
    """What the summary says of the job as it is: that it won, or the plan's gain over its best."""
    if plan.job is None:
        return []
    rows = [
        b
        for b in plan.baselines
        if b.name.startswith("job:")
        and b.prediction is not None
        and b.prediction.fits
        and b.prediction.objective_value is not None
    ]
    if plan.chosen_from == "job":
        return [
            f"the job as it is wins: {plan.job}; the plan is the job's own configuration ({plan.schedule}, "
            f"boundaries {list(plan.boundaries)}): no change found that the {plan.objective} objective ranks "
            "higher"
        ]
    if not rows:
        return [f"the job as it is: {plan.job}"]
    best = max(rows, key=lambda b: b.prediction.objective_value)
    mine = plan.prediction.objective_value
    gain = (
        f" ({mine / best.prediction.objective_value:.3f}x its {plan.objective})"
        if mine and best.prediction.objective_value > 0
        else ""
    )
    return [f"the job as it is: {plan.job}; the plan beats its best configuration ({best.name}, {best.schedule}){gain}"]
