"""The cost model, the discrete-event simulator, 'auto' parameters and trace output. Pure Python."""

import json
import math

import pytest

from hippie_ds.schedules import compile
from hippie_ds.schedules.costs import CommCost, Costs, CostsError, StageCost
from hippie_ds.schedules.ir import CompiledSchedule, Op, OpKind
from hippie_ds.schedules.deferral import resolve_auto_params
from hippie_ds.schedules.simulator import SimulationError, simulate
from hippie_ds.schedules.trace import chrome_trace, timeline_png

EXACT = dict(rel=1e-9, abs=1e-12)
FREE = CommCost(p2p_bandwidth=math.inf, data_parallel=1)


def sim(name, stages, micro_batches, costs, iterations=3, **params):
    return simulate(compile(name, stages, micro_batches, validate=False, **params), costs, iterations)


def slow_link(stages, param_bytes=4e6, shared=True, forward=1.0, backward=2.0):
    """Unit compute, free p2p, 2 replicas over a 1 MB/s link: all-reduce work = param_bytes / 1e6 s."""
    comm = CommCost(p2p_bandwidth=math.inf, allreduce_bandwidth=1e6, data_parallel=2, shared_link=shared)
    return Costs.uniform(stages, forward, backward, param_bytes=param_bytes, comm=comm)


def realistic(stages=4):
    """4 balanced stages of a 13.7M-parameter GPT (fp32: 13.7 MB of parameters per stage), 2 replicas
    across a 1 Gbit/s link shared by all stages, fast pipeline links inside the node."""
    comm = CommCost(p2p_bandwidth=10e9, allreduce_bandwidth=1.25e8, data_parallel=2, shared_link=True)
    return Costs.uniform(
        stages,
        forward=0.020,
        backward=0.040,
        activation_bytes=2.1e6,
        saved_bytes=30e6,
        param_bytes=13.7e6,
        optimizer_time=0.005,
        comm=comm,
    )


# ---------------------------------------------------------------------------------------------
# Costs


def test_allreduce_time_is_ring_formula():
    comm = CommCost(allreduce_bandwidth=1e9, allreduce_latency=1e-3, data_parallel=4)
    costs = Costs.uniform(2, param_bytes=8e9, comm=comm)
    assert costs.allreduce_time(0) == pytest.approx(2 * 3 / 4 * 8 + 2 * 3 * 1e-3, **EXACT)
    assert Costs.uniform(2, param_bytes=8e9).allreduce_time(1) == 0.0  # r = 1
    # a bf16 wire under fp32 gradients (communication_data_type): half the bytes cross the link
    half = Costs.uniform(2, param_bytes=8e9, comm=comm.model_copy(update={"wire_ratio": 0.5}))
    assert half.allreduce_work(0) == pytest.approx(costs.allreduce_work(0) / 2, **EXACT)


def test_costs_from_file_single_mapping_and_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stages: {forward: 1, backward: 2, param_bytes: 1e6}\ncomm: {data_parallel: 2}\n")
    costs = Costs.from_file(path, num_stages=3)
    assert len(costs.stages) == 3 and costs.stages[2].param_bytes == 1e6 and costs.comm.data_parallel == 2
    with pytest.raises(CostsError, match="num_stages"):
        Costs.from_file(path)
    jpath = tmp_path / "c.json"
    jpath.write_text(json.dumps({"stages": [{"forward": 1, "backward": 2}, {"forward": 3, "backward": 4}]}))
    costs = Costs.from_file(jpath)
    assert [s.forward for s in costs.stages] == [1, 3] and costs.comm == CommCost()
    with pytest.raises(CostsError, match="lists 2 stages, expected 4"):
        Costs.from_file(jpath, num_stages=4)


@pytest.mark.parametrize(
    "text, field",
    [
        ("stages: [{forward: 1}]", "stages.0.backward"),
        ("stages: [{forward: 1, backward: 1, forwrd: 2}]", "stages.0.forwrd"),
        ("stages: [{forward: -1, backward: 1}]", "stages.0.forward"),
        ("stages: [{forward: 1, backward: 1}]\ncomm: {data_parallel: 0}", "comm.data_parallel"),
        ("comm: {}", "stages"),
    ],
)
def test_costs_errors_name_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(CostsError, match=field.replace(".", r"\.")):
        Costs.from_file(path)


def test_costs_from_layers():
    layers = [dict(forward=1, backward=2, param_bytes=10, saved_bytes=5, output_bytes=100 + i) for i in range(5)]
    a = Costs.from_layers(layers, [0, 2, 5])
    b = Costs.from_layers(layers, [0, 2])  # start indices only
    assert a == b
    assert a.stages[0] == StageCost(
        forward=2,
        backward=4,
        param_bytes=20,
        saved_bytes=10,
        activation_bytes=101,
        layers=[{"param_bytes": 10, "backward": 2}] * 2,
    )  # kept for partial deferral
    assert a.stages[1].forward == 3 and a.stages[1].activation_bytes == 104
    with pytest.raises(CostsError, match="strictly increasing"):
        Costs.from_layers(layers, [0, 3, 3])
    with pytest.raises(CostsError, match=r"layer_costs\[1\]: field backward"):
        Costs.from_layers([dict(forward=1, backward=1), dict(forward=1)], [0, 1])


# ---------------------------------------------------------------------------------------------
# Identities with equal costs and free communication


@pytest.mark.parametrize("forward, backward", [(1.0, 2.0), (1.0, 1.0)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_bubble_identity_and_memory(name, forward, backward):
    for K in range(1, 7):
        costs = Costs.uniform(K, forward, backward, saved_bytes=10.0, comm=FREE)
        for M in range(1, 13):
            res = sim(name, K, M, costs)
            assert res.step_time == pytest.approx((M + K - 1) * (forward + backward), **EXACT), (K, M)
            assert res.bubble_fraction == pytest.approx((K - 1) / (M + K - 1), **EXACT), (K, M)
            peaks = [p["peak_activation_microbatches"] for p in res.per_stage]
            expected = [M] * K if name == "gpipe" else [min(K - s, M) for s in range(K)]
            assert peaks == expected, (K, M)
            assert [p["peak_activation_bytes"] for p in res.per_stage] == [10.0 * p for p in expected]
            assert res.throughput == pytest.approx(M / res.step_time, **EXACT)


@pytest.mark.parametrize("weight", [None, 0.5, 0.8])
def test_zb_h1_bubble_and_memory(weight):
    """ZB-H1's bubble is (K-1)(F + B - W) (the paper's; a third of 1F1B's (K-1)(F+B+W) when
    F = B = W), its peak K micro-batches on every stage (activations held until W)."""
    F, backward = 1.0, 2.0
    W = backward / 2 if weight is None else weight
    for K in range(1, 7):
        costs = Costs.uniform(K, F, backward, saved_bytes=10.0, comm=FREE)
        costs = Costs(stages=[s.model_copy(update={"backward_weight": weight}) for s in costs.stages], comm=FREE)
        for M in range(K, 13):
            res = sim("zb-h1", K, M, costs)
            bubble = (K - 1) * (F + (backward - W) - W) if W <= backward - W else None
            if bubble is not None:  # a W longer than B leaves the cool-down's W's exposed
                assert res.step_time == pytest.approx(M * (F + backward) + bubble, **EXACT), (K, M, W)
            assert res.step_time <= sim("1f1b", K, M, costs).step_time + 1e-9
            assert [p["peak_activation_microbatches"] for p in res.per_stage] == [K] * K, (K, M)


def test_zb_h1_with_fewer_micro_batches_than_stages():
    """M < K (stock 1F1B runs it, so zb-h1 does): faster than 1f1b whenever W takes time (the W's
    still fill the cool-down), every stage holding its M micro-batches."""
    F, backward = 1.0, 2.0
    for weight in (0.5, 1.0, 1.5):
        for K in range(2, 7):
            costs = Costs.uniform(K, F, backward, saved_bytes=10.0, comm=FREE)
            costs = Costs(stages=[s.model_copy(update={"backward_weight": weight}) for s in costs.stages], comm=FREE)
            for M in range(1, K):
                res = sim("zb-h1", K, M, costs)
                assert res.step_time < sim("1f1b", K, M, costs).step_time, (K, M, weight)
                assert [p["peak_activation_microbatches"] for p in res.per_stage] == [M] * K, (K, M)


def test_issuing_communication_holds_the_caller():
    """A non-blocking send holds its stage for send_issue_time and starting an all-reduce for
    allreduce_issue_time (a core shared with gloo); blocking sends are timed as transfers only."""
    K, M, issue = 2, 4, 0.25

    def issuing(costs, **update):
        return Costs(stages=[s.model_copy(update=update) for s in costs.stages], comm=costs.comm)

    base = Costs.uniform(K, 1.0, 2.0, comm=FREE)
    zb, zb_issuing = sim("zb-h1", K, M, base), sim("zb-h1", K, M, issuing(base, send_issue_time=issue))
    assert zb.step_time + issue <= zb_issuing.step_time + 1e-9  # every send of the critical path pays
    assert zb_issuing.step_time <= zb.step_time + 2 * M * issue + 1e-9
    blocking = sim("1f1b", K, M, issuing(base, send_issue_time=issue))
    assert blocking.step_time == pytest.approx(sim("1f1b", K, M, base).step_time, **EXACT)
    link = slow_link(K)
    hidden = sim("hippie", K, M, link, deferred_stages=[0])
    started = sim("hippie", K, M, issuing(link, allreduce_issue_time=issue), deferred_stages=[0])
    assert hidden.step_time + issue <= started.step_time + 1e-9 <= hidden.step_time + 2 * K * issue + 2e-9


def test_an_allreduce_in_flight_takes_compute_from_its_stage():
    """allreduce_cpu_time lengthens a stage whose all-reduce is hidden behind its compute; a
    blocking all-reduce's transfer covers it, and without data-parallel peers nothing is charged."""
    K, M, cpu = 2, 4, 0.25

    def charging(costs, stages):
        return Costs(
            stages=[
                c.model_copy(update={"allreduce_cpu_time": cpu}) if s in stages else c
                for s, c in enumerate(costs.stages)
            ],
            comm=costs.comm,
        )

    link = slow_link(K)  # 4 s all-reduces: longer than any stage's compute
    hidden = sim("hippie", K, M, link, deferred_stages=[0])
    charged = sim("hippie", K, M, charging(link, {0}), deferred_stages=[0])
    assert hidden.step_time + cpu <= charged.step_time + 1e-9 <= hidden.step_time + 2 * K * cpu + 2e-9
    covered = sim("hippie", K, M, charging(link, {1}), deferred_stages=[0])  # stage 1 waits for its own
    assert covered.step_time == pytest.approx(hidden.step_time, **EXACT)
    alone = Costs.uniform(K, 1.0, 2.0, comm=FREE)
    assert sim("hippie", K, M, charging(alone, {0, 1})).step_time == pytest.approx(
        sim("hippie", K, M, alone).step_time, **EXACT
    )


def test_split_costs_are_checked():
    assert StageCost(forward=1, backward=2).input_time == StageCost(forward=1, backward=2).weight_time == 1.0
    assert StageCost(forward=1, backward=2, backward_weight=0.5).input_time == 1.5
    with pytest.raises(ValueError, match="backward_weight = 3.0 exceeds backward = 2.0"):
        StageCost(forward=1, backward=2, backward_weight=3)


def test_hippie_last_stage_holds_one_micro_batch():
    for K in range(2, 7):
        for M in range(1, 13):
            res = sim("hippie", K, M, Costs.uniform(K, comm=FREE))
            peaks = [p["peak_activation_microbatches"] for p in res.per_stage]
            assert peaks == [M] * (K - 1) + [1], (K, M)


# The brief's worked example (section 1): K=4, M=4, F=1, B=2, first step.
BRIEF_COMPUTE_START = [0.0, 1.0, 2.0, 3.0]
BRIEF_COMPUTE_END = [21.0, 19.0, 17.0, 15.0]


def test_brief_worked_example_builtin_hippie():
    res = sim("hippie", 4, 4, Costs.uniform(4, 1.0, 2.0, comm=FREE))
    first = res.timeline[0]
    assert first["compute_start"] == pytest.approx(BRIEF_COMPUTE_START, **EXACT)
    assert first["compute_end"] == pytest.approx(BRIEF_COMPUTE_END, **EXACT)
    assert first["step_time"] == pytest.approx(21.0, **EXACT)
    # ... and the flush-pipeline bubble identity holds for hippie too: its non-blocking
    # activation sends let the GPipe-ordered stages run their forwards back to back.
    for K in range(1, 7):
        for M in range(1, 13):
            res = sim("hippie", K, M, Costs.uniform(K, 1.0, 2.0, comm=FREE))
            assert res.bubble_fraction == pytest.approx((K - 1) / (M + K - 1), **EXACT), (K, M)


# ---------------------------------------------------------------------------------------------
# Communication costs


def test_p2p_transfer_time_and_optimizer_step():
    comm = CommCost(p2p_bandwidth=1e6, p2p_latency=0.5)
    costs = Costs.uniform(2, 1.0, 1.0, activation_bytes=1e6, optimizer_time=0.25, comm=comm)
    # F [0,1), activation [1,2.5), F [2.5,3.5), B [3.5,4.5), gradient [4.5,6), B [6,7), step 0.25.
    assert sim("gpipe", 2, 1, costs).step_time == pytest.approx(7.25, **EXACT)


def test_shared_link_slows_concurrent_allreduces():
    # 1f1b, K=2, M=2: both stages reach reduce_grads together (after reduce_tied_grads), 1 s of work each.
    shared = sim("1f1b", 2, 2, slow_link(2, param_bytes=1e6, shared=True))
    alone = sim("1f1b", 2, 2, slow_link(2, param_bytes=1e6, shared=False))
    assert alone.step_time == pytest.approx(9.0 + 1.0, **EXACT)
    assert shared.step_time == pytest.approx(9.0 + 2.0, **EXACT)
    assert [p["allreduce_time"] for p in shared.per_stage] == pytest.approx([2.0, 2.0], **EXACT)
    assert [p["allreduce_time"] for p in alone.per_stage] == pytest.approx([1.0, 1.0], **EXACT)
    assert shared.allreduce_on_critical_path == pytest.approx(2.0, **EXACT)
    big = sim("1f1b", 4, 8, slow_link(4, shared=True))
    assert big.step_time > sim("1f1b", 4, 8, slow_link(4, shared=False)).step_time


def test_tied_groups_decide_who_waits_at_reduce_tied_grads():
    # 1f1b, K=2, M=2: stage 1's last backward ends at 7, stage 0's at 9. Waiting for each other at
    # reduce_tied_grads (tied groups not known, or a module tied across both) their all-reduces
    # share the link from 9; with no tied module stage 1 all-reduces alone from 7 (DeepSpeed's
    # ReduceTiedGrads all-reduces only tied modules' gradients, over the stages that hold them).
    base = slow_link(2, param_bytes=1e6, shared=True)
    step = {}
    for groups in (None, [[0, 1]], [], [[0]]):
        res = sim("1f1b", 2, 2, base.model_copy(update={"tied_groups": groups}))
        step[str(groups)] = res.step_time
        call = 2 * res.step_time  # the third call starts when the second has ended
        starts = {e.stage: e.start - call for e in res.events if e.name == "allreduce(grads)" and e.start >= call}
        assert starts == ({0: 9.0, 1: 9.0} if groups in (None, [[0, 1]]) else {0: 9.0, 1: 7.0})
    assert step == pytest.approx({"None": 11.0, "[[0, 1]]": 11.0, "[]": 10.0, "[[0]]": 10.0}, **EXACT)


@pytest.mark.parametrize("groups", [[[0, 2]], [[1, 1]], [[]]])
def test_tied_groups_must_name_distinct_stages(groups):
    with pytest.raises(CostsError, match=r"tied_groups\[0\]"):
        Costs.from_dict({"stages": [{"forward": 1, "backward": 1}] * 2, "tied_groups": groups})


def test_allreduce_latency():
    costs = slow_link(2, param_bytes=1e6, shared=False)
    costs = costs.model_copy(update={"comm": costs.comm.model_copy(update={"allreduce_latency": 0.125})})
    assert sim("1f1b", 2, 2, costs).step_time == pytest.approx(9.0 + 1.0 + 2 * 0.125, **EXACT)


@pytest.mark.parametrize("costs", [slow_link(4), realistic()], ids=["unit", "realistic"])
def test_hippie_hides_allreduce(costs):
    deferred = sim("hippie", 4, 8, costs, deferred_stages=[0, 1])
    eager = sim("hippie", 4, 8, costs, deferred_stages=[])
    auto = sim("hippie", 4, 8, costs, **resolve_auto_params("hippie", 4, 8, costs))
    f1b = sim("1f1b", 4, 8, costs)
    assert deferred.per_stage[0]["exposed_allreduce"] < eager.per_stage[0]["exposed_allreduce"]
    assert auto.per_stage[0]["exposed_allreduce"] < eager.per_stage[0]["exposed_allreduce"]
    assert auto.step_time <= f1b.step_time
    assert auto.allreduce_on_critical_path < f1b.allreduce_on_critical_path
    for res in (deferred, eager, auto):
        buffered = [p["stage"] for p in res.per_stage if p["gradient_buffer_bytes"] > 0]
        assert buffered == res.params["deferred_stages"]
        assert all(p["gradient_buffer_bytes"] in (0.0, costs.stages[0].param_bytes) for p in res.per_stage)
    assert all(p["gradient_buffer_bytes"] == 0 for p in f1b.per_stage)


def test_realistic_hippie_deferral_beats_1f1b():
    costs = realistic()
    assert sim("hippie", 4, 8, costs, deferred_stages=[0, 1]).step_time <= sim("1f1b", 4, 8, costs).step_time


def test_buffered_allreduce_crosses_calls():
    res = sim("hippie", 4, 8, slow_link(4), iterations=3, deferred_stages=[0, 1])
    for s in (0, 1):
        ars = [e for e in res.events if e.stage == s and e.name == "allreduce(buffer)"]
        assert len(ars) == 2  # the first call has nothing buffered; later calls reduce the previous gradient
        ends = [t["stage_end"][s] for t in res.timeline]
        # started as the call begins (after the previous call ended), done before this call ends
        assert all(prev_end <= ar.start < ar.end <= end for ar, prev_end, end in zip(ars, ends, ends[1:]))
    # the first call's wait and apply are free: nothing buffered yet
    first_apply = [e for e in res.events if e.stage == 0 and e.name == "apply_buffered_update"][0]
    assert first_apply.end == first_apply.start


def test_resolve_auto_params_defers_early_stages():
    for costs in (slow_link(4, param_bytes=2.5e6), slow_link(4, param_bytes=4e6, shared=False)):
        for name in ("hippie", "hippie-1f1b"):
            assert resolve_auto_params(name, 4, 8, costs) == {"deferred_stages": [0, 1]}, name
    # no data parallelism: nothing to hide, nothing deferred
    assert resolve_auto_params("hippie", 4, 8, Costs.uniform(4, comm=FREE)) == {"deferred_stages": []}
    # explicit values are kept; schedules without 'auto' parameters pass through
    assert resolve_auto_params("hippie", 4, 8, slow_link(4), params={"deferred_stages": [2]}) == {
        "deferred_stages": [2]
    }
    assert resolve_auto_params("1f1b", 4, 8, slow_link(4)) == {}


def test_errors():
    with pytest.raises(SimulationError, match="costs describe 3 stages"):
        simulate(compile("1f1b", 4, 4, validate=False), Costs.uniform(3))
    ops = [[[Op(OpKind.RECV_GRAD, 0, 0, 0)]], [[Op(OpKind.RECV_ACTIVATION, 1, 0, 0)]]]
    bad = CompiledSchedule("bad", 2, 1, {}, ops, [2, 2])
    with pytest.raises(SimulationError, match="deadlock.*stage 0 blocked.*stage 1 blocked"):
        simulate(bad, Costs.uniform(2))


# ---------------------------------------------------------------------------------------------
# Results and traces


def test_result_dict_is_json():
    res = sim("hippie", 4, 4, realistic(), iterations=2)
    data = json.loads(json.dumps(res.to_dict()))
    assert data["schedule"] == "hippie" and len(data["per_stage"]) == 4 and len(data["events"]) == len(res.events)
    for p in data["per_stage"]:
        assert p["idle"] == pytest.approx(data["step_time"] - p["busy"], **EXACT)
        assert p["exposed_comm"] == pytest.approx(
            p["exposed_allreduce"] + p["exposed_p2p"] + p["exposed_sync"], **EXACT
        )


def test_events_cover_every_op():
    compiled = compile("hippie", 3, 4, validate=False, deferred_stages=[0])
    res = simulate(compiled, slow_link(3), iterations=2)
    n_ops = sum(len(list(compiled.ops(s))) for s in range(3))
    allreduces = [e for e in res.events if e.name.startswith("allreduce(")]
    broadcasts = [e for e in res.events if e.name == "loss_broadcast"]
    # stages 1-2 all-reduce every call; deferred stage 0 only once something is buffered
    assert len(broadcasts) == 3 * 2 and len(allreduces) == 2 * 2 + 1
    assert len(res.events) == 2 * n_ops + len(allreduces) + len(broadcasts)
    assert all(e.end >= e.start for e in res.events)


def test_chrome_trace(tmp_path):
    res = sim("hippie", 4, 4, slow_link(4), iterations=2)
    path = tmp_path / "trace.json"
    chrome_trace(res.events, path, time_unit_s=1e-3)
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.events)
    assert {e["pid"] for e in xs} == {0, 1, 2, 3}
    assert {e["tid"] for e in xs if e["cat"] == "comm"} == {1} and {e["tid"] for e in xs if e["cat"] != "comm"} == {0}
    f = next(e for e in xs if e["name"] == "F3" and e["pid"] == 0)
    assert f["dur"] == pytest.approx(1e3) and f["args"]["micro_batch"] == 3  # 1 unit = 1 ms = 1000 us
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {s: f"stage {s}" for s in range(4)}


def test_chrome_trace_measured_rank_dicts(tmp_path):
    events = [
        {"rank": 2, "stage": 1, "name": "F0", "category": "forward", "start": 0.0, "end": 0.5, "micro_batch": 0},
        {"rank": 2, "stage": 1, "name": "allreduce(grads)", "cat": "comm", "start": 0.5, "end": 0.9},
    ]
    doc = chrome_trace(events, tmp_path / "t.json", process_names={2: "rank 2 / node 1"})
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"]) for e in xs] == [(2, 0), (2, 1)]
    assert xs[1]["dur"] == pytest.approx(0.4e6)
    assert [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"] == ["rank 2 / node 1"]
    with pytest.raises(ValueError, match="'stage' or 'rank'"):
        chrome_trace([{"name": "x", "start": 0, "end": 1}])


def test_timeline_png(tmp_path):
    res = sim("hippie", 4, 8, realistic(), iterations=2)
    path = tmp_path / "timeline.png"
    timeline_png(res.events, path, "hippie K=4 M=8")
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_partial_deferral_moves_a_share_of_the_allreduce_into_the_step():
    """delayed_fraction f of a deferred stage: the buffer carries f of its gradient (and its
    bytes), the in-step all-reduce the rest; the exposed all-reduce lies between deferring all
    of the stage and deferring nothing."""
    costs = slow_link(4)
    compiled = compile("hippie", 4, 8, validate=False, deferred_stages=[0])
    whole = simulate(compiled, costs)
    part = simulate(compiled, costs, delayed_fraction={0: 0.25})
    eager = sim("hippie", 4, 8, costs, deferred_stages=[])
    assert whole.per_stage[0]["delayed_fraction"] == 1.0 and part.per_stage[0]["delayed_fraction"] == 0.25
    assert part.per_stage[0]["gradient_buffer_bytes"] == pytest.approx(0.25 * costs.stages[0].param_bytes)
    assert (
        whole.per_stage[0]["exposed_allreduce"]
        < part.per_stage[0]["exposed_allreduce"]
        < eager.per_stage[0]["exposed_allreduce"]
    )
    assert whole.step_time < part.step_time < eager.step_time
    assert part.per_stage[1]["delayed_fraction"] == 0.0  # not a deferred stage
