"""Cost files from measurements, the ``hippie.costs`` that ``auto`` parameters and the simulator read:
from the engine's per-rank timelines (``hippie.timeline_dir``: what each instruction took) or from
a layer profile (``hippie.profile`` / ``hippie-ds profile``) cut at stage boundaries. The CLI is
``hippie-ds costs``; the bench's analysis maps its timings with :func:`stage_fields` too. Pure.

Which instruction's time is which cost (one place): ``ForwardPass`` forward, ``BackwardPass``
backward; a fused last stage (``ForwardBackwardPass``) is split by the other stages' forward share;
a split backward (``BackwardInputPass`` + ``BackwardWeightPass``) is backward with its weight part
``backward_weight``; the update instructions are ``optimizer_time``; a non-blocking send's issue
``send_issue_time``; ``StartAllReduce`` ``allreduce_issue_time``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

from .costs import CommCost, Costs, _comm_dict
from .ir import OP_INFO

# the instructions of the update ops (OP_INFO role "update") and of the non-blocking sends
UPDATE_KINDS = tuple(info.instruction for info in OP_INFO.values() if info.role == "update")
SEND_KINDS = tuple(info.nonblocking_instruction for info in OP_INFO.values() if info.nonblocking_instruction)
DEFAULT_FORWARD_SHARE = 1 / 3  # forward / (forward + backward) when no stage measured both


def forward_share(medians: Iterable[Mapping[str, float]]) -> float:
    """Mean forward / (forward + backward) over the stages that ran both apart."""
    shares = [
        m["ForwardPass"] / (m["ForwardPass"] + m["BackwardPass"])
        for m in medians
        if m.get("ForwardPass") and m.get("BackwardPass")
    ]
    return statistics.mean(shares) if shares else DEFAULT_FORWARD_SHARE


def stage_fields(median: Mapping[str, float], share: float) -> dict:
    """``StageCost`` fields from one stage's median time (s) per instruction kind."""
    f, b = median.get("ForwardPass"), median.get("BackwardPass")
    if (f is None or b is None) and "ForwardBackwardPass" in median:  # fused last stage
        f, b = share * median["ForwardBackwardPass"], (1 - share) * median["ForwardBackwardPass"]
    split = {}
    if b is None and "BackwardWeightPass" in median:  # zb-h1, hippie-zb: B + W
        w = median["BackwardWeightPass"]
        b, split = median.get("BackwardInputPass", 0.0) + w, {"backward_weight": w}
    sends = [median[k] for k in SEND_KINDS if median.get(k)]
    return {
        "forward": f or 0.0,
        "backward": b or 0.0,
        **split,
        "optimizer_time": sum(median.get(k, 0.0) for k in UPDATE_KINDS),
        "send_issue_time": statistics.mean(sends) if sends else 0.0,
        "allreduce_issue_time": median.get("StartAllReduce", 0.0),
    }


def timeline_medians(timelines: Sequence[Mapping], skip_steps: int = 1) -> dict[int, dict[str, float]]:
    """{stage: {instruction kind: median seconds}} over the ranks' timelines (the JSON the engine
    writes: ``stage`` and ``events``), leaving out each rank's first ``skip_steps`` recorded calls
    (warm-up). Communication-in-flight events are not instructions and are left out."""
    durations: dict[int, dict[str, list[float]]] = {}
    for tl in timelines:
        if "stage" not in tl or "events" not in tl:
            raise ValueError(
                "a timeline needs 'stage' and 'events' (the file HippiePipelineEngine.write_timeline writes)"
            )
        steps = sorted({e["step"] for e in tl["events"]})
        kept = set(steps[skip_steps:])
        per_kind = durations.setdefault(int(tl["stage"]), {})
        for e in tl["events"]:
            if e["step"] in kept and e.get("category") != "comm":
                per_kind.setdefault(e["kind"], []).append(e["end"] - e["start"])
    out = {s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in durations.items()}
    if not out or any(not m for m in out.values()):
        raise ValueError(
            f"no instruction left after skipping {skip_steps} step(s) per rank: record more steps "
            "(hippie.timeline_steps) or skip fewer"
        )
    return out


def costs_from_timelines(
    timelines: Sequence[Mapping], comm: CommCost | Mapping | None = None, skip_steps: int = 1
) -> Costs:
    """A cost file's ``Costs`` from every stage's timelines; ``param_bytes`` and
    ``activation_bytes`` from the timelines' ``param_bytes`` / ``activation_bytes`` when written."""
    medians = timeline_medians(timelines, skip_steps)
    stages = sorted(medians)
    if stages != list(range(len(stages))):
        raise ValueError(f"timelines of stages {stages}: every stage 0..{max(stages)} needs at least one")
    share = forward_share(medians.values())
    sizes = {int(tl["stage"]): tl for tl in timelines}
    return Costs.from_dict(
        {
            "stages": [
                {
                    **stage_fields(medians[s], share),
                    "param_bytes": float(sizes[s].get("param_bytes") or 0.0),
                    "activation_bytes": float(sizes[s].get("activation_bytes") or 0.0),
                }
                for s in stages
            ],
            "comm": _comm_dict(comm),
        }
    )


def costs_from_profile(profile, boundaries: Sequence[int], comm: CommCost | Mapping | None = None) -> Costs:
    """A cost file's ``Costs`` from a layer profile (``hippie_ds.planner.Profile``) cut at
    ``boundaries`` (DeepSpeed ``parts`` [0, b1, ..., N], or the stage starts); the loss, when
    profiled, counts on the last stage; a layer's ``split_extra`` (what the engine's split backward
    costs beyond the whole one) in its stage's input pass, as the planner charges it."""
    layers = [
        {
            "forward": x.forward,
            "backward": x.backward,
            "backward_weight": x.weight_time,
            "split_extra": x.split_time,
            "recompute": x.recompute_time,
            "saved_bytes": x.saved,
            "param_bytes": x.param_bytes,
            "output_bytes": x.output_bytes,
        }
        for x in profile.layers
    ]
    if profile.loss is not None:
        last = layers[-1]
        last.update(
            forward=last["forward"] + profile.loss.forward,
            backward=last["backward"] + profile.loss.backward,
            backward_weight=last["backward_weight"],
            saved_bytes=last["saved_bytes"] + profile.loss.saved,
        )
    return Costs.from_layers(layers, boundaries, comm)


def uniform_boundaries(num_layers: int, stages: int) -> list[int]:
    """DeepSpeed's ``partition_uniform`` parts for ``stages`` (its ``partition_method: uniform``)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} stages of {num_layers} layers: need 1 <= stages <= layers")
    parts = [0] * (stages + 1)
    chunk, residual = divmod(num_layers, stages)
    for p in range(stages):
        parts[p + 1] = parts[p] + chunk + (1 if p < residual else 0)
    return parts
