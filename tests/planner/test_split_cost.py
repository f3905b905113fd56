"""The split backward priced as the engine runs it: a profile's ``split_extra`` (what
the engine's I + W cost beyond the whole backward, timed by the profilers on the engine's own split)
is charged in the input pass by the planner's analytic model and by the simulator's costs, never on
a first stage whose data needs no gradient (its whole backward runs as W, one autograd call); a plan
changes when the split costs more than the whole backward. Pure (the planner), and the profilers'
timing of one layer in this process."""

import pytest
import torch

from hippie_ds.planner import LayerProfile, Profile, make_plan, parse_cluster
from hippie_ds.planner import model as pl
from hippie_ds.planner.sim_costs import _costs
from hippie_ds.schedules.costs import Costs, StageCost

MS = 1e-3


def _profile(extra: float | None, first_extra: float | None = None, n: int = 16) -> Profile:
    """An embedding fed token ids (no split: split_extra None) and n - 1 equal blocks whose split
    costs ``extra`` x their backward beyond it."""
    layers = [
        LayerProfile(
            name="Embedding",
            forward=0.2 * MS,
            backward=0.4 * MS,
            backward_weight=0.4 * MS,
            split_extra=first_extra,
            output_bytes=1e6,
            param_bytes=1e7,
        )
    ]
    layers += [
        LayerProfile(
            name="Block",
            forward=1 * MS,
            backward=2 * MS,
            backward_weight=1 * MS,
            split_extra=None if extra is None else extra * 2 * MS,
            output_bytes=1e6,
            param_bytes=1e7,
        )
        for _ in range(n - 1)
    ]
    return Profile(model="blocks", batch_size=8, layers=layers)


def test_stage_costs_charge_the_split_in_the_input_pass():
    st = StageCost(forward=1, backward=2, backward_weight=0.8, split_extra=0.5)
    assert st.input_time == pytest.approx(1.7) and st.weight_time == 0.8
    assert StageCost(forward=1, backward=2, backward_weight=0.8).input_time == pytest.approx(1.2)
    costs = Costs.from_layers([{"forward": 1, "backward": 2, "split_extra": 0.25}] * 4, [0, 2, 4])
    assert [s.split_extra for s in costs.stages] == [0.5, 0.5]
    assert _profile(0.2).scaled(16).layers[1].split_extra == pytest.approx(0.8 * MS)


def test_the_planner_and_the_simulator_charge_the_split_but_not_on_a_stage_fed_data():
    cluster = parse_cluster("1x4,80GB,100Gbit")
    model = pl._Model(_profile(0.25), cluster, 64, 4.0, "mean", cluster.device_memory)
    lay = model.layout(4, [0, 4, 8, 12, 16])
    free = pl._Model(_profile(None), cluster, 64, 4.0, "mean", cluster.device_memory)
    ks = [0] * 4
    from hippie_ds.planner.split_bounds import split_stage_times

    B = [2 * MS * (len(range(a, b))) for a, b in zip(lay.parts, lay.parts[1:])]
    I, W = split_stage_times(model, lay, 1.0, ks, B)
    I0, W0 = split_stage_times(free, free.layout(4, lay.parts), 1.0, ks, B)
    assert W == W0 and W[0] == pytest.approx(0.4 * MS + 3 * 2 * MS)  # stage 0: its whole backward as W
    assert I[0] == I0[0] and [i - j for i, j in zip(I[1:], I0[1:])] == pytest.approx([4 * 0.5 * MS] * 3)
    sim = _costs(model, lay, 8, ks).stages
    assert sim[0].split_extra == 0 and sim[0].weight_time == pytest.approx(W[0])
    assert [s.input_time for s in sim[1:]] == pytest.approx(I[1:])
    # the analytic step stays a lower bound of the simulated one, and both grow with the split's cost
    from hippie_ds.planner import evaluate

    for m in (free, model):
        step, deferred = m.step_time(m.layout(4, lay.parts), "zb-h1", 1.0, 8, ks)
        simulated = evaluate.simulate_configuration(
            m, m.layout(4, lay.parts), 8, 8, "zb-h1", ks, deferred, auto_limit=10**9
        ).step
        assert step <= simulated * (1 + 1e-9)
    assert (
        model.step_time(lay, "zb-h1", 1.0, 8, ks)[0] > free.step_time(free.layout(4, lay.parts), "zb-h1", 1.0, 8, ks)[0]
    )


def test_a_stage_fed_floating_point_data_splits_like_the_others():
    """DeepSpeed's first stage marks floating-point data as requiring grad: its first layer's split
    was timed (split_extra set), so stage 0 runs I and W and pays the split too."""
    cluster = parse_cluster("1x4,80GB,100Gbit")
    model = pl._Model(_profile(0.25, first_extra=0.0), cluster, 64, 4.0, "mean", cluster.device_memory)
    lay = model.layout(4, [0, 4, 8, 12, 16])
    assert lay.wgt[0] == pytest.approx(0.4 * MS + 3 * 1 * MS)  # the layers' W, not the whole backward
    assert _costs(model, lay, 8, [0] * 4).stages[0].split_extra == pytest.approx(3 * 0.5 * MS)


def test_a_plan_changes_when_the_split_costs_more_than_the_whole_backward():
    cluster = parse_cluster("1x4,80GB,100Gbit")
    kw = dict(objective="throughput", baselines=False, depths=[4], micro_batch_sizes=[8], schedules=["1f1b", "zb-h1"])
    # 16 micro-batches on 4 stages of about 4 blocks (F 4, I 4, W 4 ms): 1F1B's bubble 3 (F + B) = 36 ms
    free = make_plan(_profile(None), cluster, 128, **kw)
    assert free.schedule == "zb-h1"  # priced free, the split removes most of the bubble
    measured = make_plan(_profile(0.25), cluster, 128, **kw)  # +25%, as measured on the GPT example's blocks
    assert measured.schedule == "1f1b"
    assert measured.prediction.step_time > free.prediction.step_time


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def test_the_profiler_times_the_engines_split_and_leaves_gradients_alone():
    from hippie_ds.adapter.profiling.layer_timing import as_stage_input, measure_layer

    block, x = _Block(), as_stage_input(torch.randn(16, 64))
    params = list(block.parameters())
    held = block.fc.weight.grad = torch.full_like(block.fc.weight, 7.0)  # a job's gradient, kept as it was
    record = measure_layer(block, x, params, 1.0, repeats=3, warmup=1, accumulate=False).record
    assert record["split_extra"] is not None and record["split_extra"] >= 0
    assert 0 <= record["backward_weight"] <= record["backward"]
    assert block.fc.weight.grad is held and torch.all(held == 7.0) and block.fc.bias.grad is None and x.grad is None
    emb = torch.nn.Embedding(10, 8)  # token ids: no input gradient, the whole backward is W, no split
    record = measure_layer(
        emb, torch.randint(0, 10, (4, 3)), list(emb.parameters()), 1.0, repeats=2, warmup=1, accumulate=False
    ).record
    assert record["split_extra"] is None and record["backward_weight"] == record["backward"]
    record = measure_layer(
        torch.nn.ReLU(), as_stage_input(torch.randn(4, 8)), [], 0.0, repeats=2, warmup=1, accumulate=False
    ).record
    assert record["split_extra"] == 0.0 and record["backward_weight"] == 0.0
