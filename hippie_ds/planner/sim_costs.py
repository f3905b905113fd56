"""What the simulator runs for one planned configuration: the profile's layers summed into per-stage
:class:`hippie_ds.schedules.costs.Costs` (the analytic model's terms, :mod:`.model`), the host's floors
applied (:mod:`.host`). Pure Python."""

from __future__ import annotations

from typing import Sequence

from .host import apply_to_costs
from .model import _Layout, _Model


def _costs(model: _Model, lay: _Layout, b: int, ks: Sequence[int]):
    """hippie_ds Costs for a configuration (what the simulator runs), through Costs.from_layers.
    A stage's activation_bytes is what crosses its cut (branched graphs: several tensors); a link
    that crosses nodes is expressed as proportionally more bytes on the intra-node p2p bandwidth."""
    from ..schedules.costs import CommCost, Costs

    c, f = model.cluster, b / model.b0
    comm = CommCost(
        p2p_bandwidth=c.intra_node_bandwidth,
        p2p_latency=c.message_latency,
        allreduce_bandwidth=c.inter_node_bandwidth if lay.ar_inter else c.intra_node_bandwidth,
        allreduce_latency=c.latency,
        data_parallel=lay.r,
        shared_link=True,
    )
    if lay.v > 1:
        return _chunked_costs(model, lay, f, ks, comm)
    layer_costs = []
    for s, (a, e) in enumerate(zip(lay.parts, lay.parts[1:])):
        chosen = set(lay.rec[s].layers(ks[s]))
        scale = c.intra_node_bandwidth / c.inter_node_bandwidth if lay.inter_link[s] else 1.0
        held = model.stage_params([(a, e)])
        for i in range(a, e):
            layer_costs.append(
                {
                    # a re-computed layer's W runs in the input pass, the first stage's whole backward in W
                    "forward": f * model.fwd[i],
                    "backward": f * model.bwd[i],
                    # a measured W can exceed the whole backward (the split's second pass): the excess is in
                    # split_extra already (I + W - B), so W is charged at most B and I the rest
                    "backward_weight": f
                    * (
                        model.bwd[i]
                        if s == 0 and model.first_whole
                        else 0.0
                        if i in chosen
                        else min(model.wgt[i], model.bwd[i])
                    ),
                    "split_extra": f * (0.0 if (s == 0 and model.first_whole) or i in chosen else model.extra[i]),
                    "recompute": f * model.rc[i] if i in chosen else 0.0,
                    "param_bytes": held[i],
                    "output_bytes": f * lay.cut_out[s] * scale if i == e - 1 else 0.0,
                }
            )
    return with_host(model, lay, ks, Costs.from_layers(layer_costs, lay.parts, comm))


def with_host(model: _Model, lay: _Layout, ks: Sequence, costs):
    """``costs`` with the host's floors (:func:`.host.apply_to_costs`; the analytic model's terms,
    :meth:`_Model.compute_time`), one stage per part."""
    host = model.cluster.host
    if host is None:
        return costs
    return apply_to_costs(
        costs, host, model.stage_layers(lay), [len(lay.rec[s].layers(ks[s])) for s in range(lay.K)], lay.v
    )


def _chunked_costs(model: _Model, lay: _Layout, f: float, ks: Sequence, comm):
    """Costs of a layout with v chunks per stage: a stage's figures are its chunks' sums (the
    simulator times a chunk op as 1/v of its stage: unequal chunks are modelled by their
    stage's totals), its activation_bytes the largest cut its chunks send, its layers in model
    order (the first chunk's first: what partial deferral delays)."""
    from ..schedules.costs import Costs

    c = model.cluster
    stages = []
    for s in range(lay.K):
        chosen = set(lay.rec[s].layers(ks[s]))
        scale = c.intra_node_bandwidth / c.inter_node_bandwidth if lay.inter_link[s] else 1.0
        layers = [i for a, e in lay.chunk_ranges(s) for i in range(a, e)]
        held = model.stage_params(lay.chunk_ranges(s))
        # the model's first part (stage 0's chunk 0 in either layout): its whole backward is W
        first = set(range(lay.parts[0], lay.parts[1])) if s == 0 and model.first_whole else set()
        stages.append(
            {
                "forward": f * sum(model.fwd[i] for i in layers),
                "backward": f * sum(model.bwd[i] for i in layers),
                "recompute": f * sum(model.rc[i] for i in layers if i in chosen),
                "backward_weight": f
                * sum(model.bwd[i] if i in first else 0.0 if i in chosen else model.wgt[i] for i in layers),
                "split_extra": f * sum(0.0 if i in first or i in chosen else model.extra[i] for i in layers),
                "param_bytes": sum(held[i] for i in layers),
                "activation_bytes": f * lay.cut_out[s] * scale,
                "layers": [{"param_bytes": held[i], "backward": f * model.bwd[i]} for i in layers],
            }
        )
    return with_host(
        model, lay, ks, Costs.from_dict({"stages": stages, "comm": comm.model_dump()}, where="planner costs")
    )
