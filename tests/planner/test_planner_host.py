"""The host's CPU per instruction in the planner (hippie_ds/planner/host.py): fitted from samples,
scaled, applied as a floor on every instruction, and a plan whose micro-batches the host cannot feed
is not chosen. Pure: no processes."""

import pytest

from hippie_ds.planner import Cluster, make_plan, synthetic_profile
from hippie_ds.planner.host import HostCost, KindCost, Sample, fit_host_cost, host_kind


def _cluster(host=None):
    return Cluster(
        nodes=2,
        devices_per_node=4,
        device_memory=64e9,
        inter_node_bandwidth=12.5e9,
        intra_node_bandwidth=100e9,
        host=host,
    )


def test_fit_recovers_fixed_and_per_layer_terms():
    truth = HostCost(
        forward=KindCost(fixed=2e-3, per_layer=5e-4),
        backward=KindCost(fixed=3e-3, per_layer=1e-3),
        recompute_per_layer=4e-4,
        p2p=KindCost(fixed=1e-3),
        step=KindCost(fixed=1e-3, per_layer=2e-4),
    )
    samples = []
    for layers, rec in ((3, 0), (7, 0), (12, 0), (7, 7), (12, 5)):
        samples.append(Sample("forward", layers, 0, 10, 10 * truth.forward_s(layers)))
        samples.append(Sample("backward", layers, rec, 10, 10 * truth.backward_s(layers, rec)))
        samples.append(Sample("step", layers, 0, 1, truth.step_s(layers)))
        samples.append(Sample("p2p", 0, 0, 20, 20 * 1e-3))
    fit = fit_host_cost(samples, source="test")
    for kind in ("forward", "backward", "step", "p2p"):
        assert getattr(fit, kind).fixed == pytest.approx(getattr(truth, kind).fixed, rel=1e-6, abs=1e-12)
        assert getattr(fit, kind).per_layer == pytest.approx(getattr(truth, kind).per_layer, rel=1e-6, abs=1e-12)
    assert fit.recompute_per_layer == pytest.approx(4e-4, rel=1e-6)


def test_fit_keeps_terms_non_negative():
    # more layers, less CPU: the slope would be negative; the fit drops it and keeps the mean
    fit = fit_host_cost([Sample("forward", 2, 0, 1, 3e-3), Sample("forward", 8, 0, 1, 1e-3)])
    assert fit.forward.per_layer == 0.0 and fit.forward.fixed == pytest.approx(2e-3)


def test_scaled_and_kinds():
    h = HostCost(forward=KindCost(fixed=1e-3, per_layer=2e-3), recompute_per_layer=1e-3, source="m")
    s = h.scaled(8 / 16, "8 ranks a core, D = 16")
    assert s.forward.fixed == 5e-4 and s.forward.per_layer == 1e-3 and s.recompute_per_layer == 5e-4
    assert "D = 16" in s.source
    assert host_kind("ForwardPass") == "forward" and host_kind("BackwardWeightPass") == "backward"
    assert host_kind("ISendGrad") == "p2p" and host_kind("OptimizerStep") == "step"
    assert host_kind("LoadMicroBatch") == "other"


def test_cluster_file_carries_the_host(tmp_path):
    from hippie_ds.planner import parse_cluster
    import json

    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {
                "nodes": 2,
                "devices_per_node": 4,
                "device_memory": 1e9,
                "inter_node_bandwidth": 1e9,
                "host": {"forward": {"fixed": 0.01}},
            }
        )
    )
    c = parse_cluster(str(path))
    assert c.host.forward.fixed == 0.01 and c.message_latency == 0.0
    assert "host per forward" in c.describe()


def test_a_plan_the_host_cannot_feed_is_not_chosen():
    """Without a host cost the planner takes many small micro-batches (less bubble); when every
    instruction costs the host more than a small micro-batch's device time, it takes fewer, larger
    ones, and its predicted step is at least the host's work for them."""
    profile = synthetic_profile(16, seed=3, batch_size=64, time_scale=2e-3)
    kwargs = dict(global_batch=512, objective="throughput", schedules=("1f1b",), depths=(4,))
    free = make_plan(profile, _cluster(), **kwargs)
    host = HostCost(forward=KindCost(fixed=0.02), backward=KindCost(fixed=0.04), source="test")
    fed = make_plan(profile, _cluster(host), **kwargs)
    assert free.micro_batches > fed.micro_batches, (free.micro_batches, fed.micro_batches)
    # every stage issues micro_batches forwards and backwards: the step is at least their host time
    assert fed.prediction.step_time >= fed.micro_batches * (0.02 + 0.04)
    # the plan without a host cost, priced with one, is slower than the plan that knew it
    priced = make_plan(profile, _cluster(host), **{**kwargs, "micro_batch_sizes": (free.micro_batch_size,)})
    assert priced.prediction.step_time > fed.prediction.step_time
    assert fed.cluster.host is not None and fed.cluster.host.source == "test"  # the plan records what it assumed
