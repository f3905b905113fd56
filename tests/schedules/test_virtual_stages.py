"""Virtual stages: layouts, interleaved and V-shape schedules compiled, validated and
simulated (pure), and run by the engine with real ranks: interleaved-1f1b bit-identical to stock
1F1B in fp32, bf16 and bf16 + ZeRO-1 with a tied embedding, zb-v likewise (untied: its V puts the
embedding and the head on one stage, where a tied module is one parameter, so its two gradients
sum in another order), hippie-interleaved against the reference of its rule, eval_batch, and
checkpoints crossing between the layouts (DeepSpeed's per-layer files)."""

from pathlib import Path

import pytest
import torch

import reference
from launch import collect, launch

from hippie_ds import schedules
from hippie_ds.config import StalenessConfig
from hippie_ds.schedules import ScheduleError
from hippie_ds.schedules.costs import Costs
from hippie_ds.schedules.ir import OpKind
from hippie_ds.schedules.compiler import inference_stream
from hippie_ds.schedules.layout import Layout
from hippie_ds.schedules.simulator import simulate
from hippie_ds.schedules.validator import check


# ---------------------------------------------------------------------------------------------
# pure layers


def test_layouts_place_every_part_once():
    for K in range(1, 6):
        for kind, vs in (("interleaved", (1, 2, 3)), ("v", (2,))):
            for v in vs:
                layout = Layout(kind, K, v)
                placed = [layout.place(p) for p in range(K * v)]
                assert sorted(placed) == sorted((s, c) for s in range(K) for c in range(v))
                assert all(layout.part(*layout.place(p)) == p for p in range(K * v))
    inter, vee = Layout("interleaved", 4, 2), Layout("v", 4, 2)
    assert inter.next(3, 0) == (0, 1) and inter.prev(0, 1) == (3, 0)  # the wrap-around
    assert vee.next(3, 0) == (3, 1) and vee.is_last(0, 1) and vee.loads(0) and not vee.loads(3)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "hippie-interleaved"])
def test_interleaved_schedules_validate(name):
    for K in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for M in (K, 2 * K, 3 * K):
                compiled = schedules.compile(name, K, M, validate=False, virtual_stages=v)
                assert check(compiled) == [], (K, M, v)
                for s in range(K):
                    ops = list(compiled.ops(s))
                    for kind in (OpKind.FORWARD, OpKind.BACKWARD):
                        # each chunk's micro-batches in order 0..M-1: 1f1b's per-parameter order
                        for c in range(v):
                            assert [op.micro_batch for op in ops if op.kind == kind and op.chunk == c] == list(range(M))


def test_zb_v_validates_and_halves_the_bubble():
    """zb-v: every shape valid (M < K too); with F = B_input = W its bubble is well under zb-h1's
    and 1f1b's, every stage holding K micro-batches of activations (1F1B's first stage's)."""
    for K in (2, 3, 4, 8):
        for M in (1, 2, K - 1, K, 2 * K - 1, 2 * K, 3 * K):
            if M < 1:
                continue
            compiled = schedules.compile("zb-v", K, M, validate=False)
            assert check(compiled) == [], (K, M)
            for s in range(K):  # W of each chunk in micro-batch order: 1f1b's accumulation order
                ops = list(compiled.ops(s))
                for c in range(2):
                    assert [
                        op.micro_batch for op in ops if op.kind == OpKind.BACKWARD_WEIGHT and op.chunk == c
                    ] == list(range(M))
    costs = Costs.uniform(4, forward=1.0, backward=2.0)  # B = 2: input 1 + weight 1
    zbv, zbh1, one = (simulate(schedules.compile(n, 4, 8), costs) for n in ("zb-v", "zb-h1", "1f1b"))
    assert (zbv.step_time, zbh1.step_time, one.step_time) == (25.5, 27.0, 33.0)
    assert [p["peak_activation_microbatches"] for p in zbv.per_stage] == [4.0] * 4


def test_interleaved_bubble_is_megatrons():
    """Equal stage costs: the simulated bubble is (K-1)/(vM+K-1) of the step; v=1 is 1f1b's."""
    for K, M, v in [(2, 4, 2), (2, 8, 3), (4, 8, 2), (4, 8, 4), (4, 16, 2)]:
        costs = Costs.uniform(K, forward=1.0, backward=2.0)
        result = simulate(schedules.compile("interleaved-1f1b", K, M, virtual_stages=v), costs)
        assert result.bubble_fraction == pytest.approx((K - 1) / (v * M + K - 1), abs=1e-9)
        one = simulate(schedules.compile("interleaved-1f1b", K, M, virtual_stages=1), costs)
        assert one.bubble_fraction == pytest.approx(simulate(schedules.compile("1f1b", K, M), costs).bubble_fraction)
        # activations: the first stage holds Megatron's warm-up count of chunk micro-batches, 1/v each
        warmup = min(2 * (K - 1) + (v - 1) * K, v * M) + 1
        assert result.per_stage[0]["peak_activation_microbatches"] == pytest.approx(min(warmup, v * M) / v)


def test_virtual_stage_errors_name_the_problem():
    with pytest.raises(ScheduleError, match=r"virtual_stages = 2: schedule '1f1b' runs one model chunk"):
        schedules.compile("1f1b", 2, 4, virtual_stages=2)
    with pytest.raises(ScheduleError, match=r"micro_batches must be a multiple of stages"):
        schedules.compile("interleaved-1f1b", 4, 6)
    with pytest.raises(ScheduleError, match=r"at least 2 stages"):
        schedules.compile("interleaved-1f1b", 1, 4)
    with pytest.raises(ScheduleError, match=r"virtual_stages = 0"):
        schedules.compile("interleaved-1f1b", 2, 4, virtual_stages=0)
    with pytest.raises(ScheduleError, match=r"V-shape layout, which holds exactly 2 chunks"):
        schedules.compile("zb-v", 2, 4, virtual_stages=3)


def test_validator_sees_the_shared_link(tmp_path):
    """With K=2 both directions of the stage pair carry activations and gradients on one FIFO
    link (one process group, one tag): an order whose receives do not follow the sends is caught."""
    # 2 stages x 2 chunks x 2 micro-batches; stage 1 takes chunk 0's micro-batches in the other order
    path = tmp_path / "bad.yaml"
    path.write_text("""name: bad
virtual_stages: 2
compute:
  - op: forward
    at: "chunk * 2 + ((1 - mb) if stage == 1 and chunk == 0 else mb)"
    send: {blocking: false, when: same_step}
  - op: backward
    at: "4 + (1 - chunk) * 2 + mb"
    send: {blocking: false, when: same_step}
epilogue:
  - {op: reduce_grads, at: end}
  - {op: optimizer_step, at: end}
""")
    problems = check(schedules.compile(str(path), 2, 2, validate=False))
    assert any(p.stage == 1 and "mis-ordered" in p.reason and "received mb=0" in p.reason for p in problems), problems


def test_chunk_allreduce_rules(tmp_path):
    """start_allreduce(chunk): compiled right after its op, checked against the chunk's backwards,
    refused outside a compute rule's 'after'; simulated as that chunk's share of the all-reduce."""
    compiled = schedules.compile("hippie-interleaved", 2, 4, deferred_stages=[])
    for s in range(2):
        ops = list(compiled.ops(s))
        i = next(i for i, op in enumerate(ops) if op.target == "chunk")
        assert ops[i].chunk == 1 and (ops[i - 1].kind, ops[i - 1].chunk) in (
            (OpKind.SEND_GRAD, 1),
            (OpKind.BACKWARD, 1),
        )
        assert not any(op.kind == OpKind.BACKWARD and op.chunk == 1 for op in ops[i:])
    text = (Path(schedules.spec.builtin_dir()) / "hippie-interleaved.yaml").read_text()
    early = tmp_path / "early.yaml"
    early.write_text(text.replace("when: mb == micro_batches - 1 and chunk > 0", "when: mb == 0 and chunk > 0"))
    problems = check(schedules.compile(str(early), 2, 4, validate=False, deferred_stages=[]))
    assert any("start_allreduce(chunk 1) before all of its backwards" in p.reason for p in problems), problems
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(text.replace("epilogue:\n", "epilogue:\n  - {op: start_allreduce, target: chunk}\n"))
    with pytest.raises(ScheduleError, match=r"start_allreduce\(chunk\) belongs in a compute rule's 'after'"):
        schedules.compile(str(wrong), 2, 4)
    costs = Costs.uniform(
        4, forward=0.02, backward=0.04, param_bytes=13.7e6, comm={"data_parallel": 2, "allreduce_bandwidth": 1.25e8}
    )
    late = tmp_path / "late.yaml"  # the same schedule without the early chunk all-reduce
    late.write_text(text[: text.index("    after:")] + text[text.index("prologue:") :])
    step = {
        path: simulate(schedules.compile(path, 4, 8, deferred_stages=[]), costs).step_time
        for path in ("hippie-interleaved", str(late))
    }
    assert step["hippie-interleaved"] < 0.95 * step[str(late)], step


def test_one_received_gradient_per_chunk():
    """The engine keeps DeepSpeed's received-gradient slot per chunk: every virtual built-in fits
    it, and a second gradient of the same chunk received early is refused."""
    from dataclasses import replace
    from hippie_ds.schedules.stage_checks import check_single_grad_slot

    for name in ("interleaved-1f1b", "hippie-interleaved", "zb-v"):
        for K in (2, 4):
            c = schedules.compile(name, K, 2 * K, validate=False)
            for s in range(K):
                check_single_grad_slot(c, s)
    c = schedules.compile("interleaved-1f1b", 2, 4, validate=False)
    steps = c.streams[0]
    t, i = next(
        (t, i)
        for t, step in enumerate(steps)
        for i, op in enumerate(step)
        if op.kind == OpKind.RECV_GRAD and op.chunk == 1 and op.micro_batch == 1
    )
    early = steps[t].pop(i)
    first = next(t for t, step in enumerate(steps) if any(op.kind == OpKind.RECV_GRAD and op.chunk == 1 for op in step))
    steps[first].insert(0, replace(early, step=first))  # chunk 1's mb 1 received before its mb 0
    with pytest.raises(ValueError, match="receives the gradient of micro-batch 0 before the backward of micro-batch 1"):
        check_single_grad_slot(c, 0)


def test_inference_stream_runs_every_chunk_once():
    layout = Layout("interleaved", 2, 2)
    for s in range(2):
        ops = [op for step in inference_stream(layout, s, 3) for op in step]
        assert sorted((op.chunk, op.micro_batch) for op in ops if op.kind == OpKind.FORWARD) == [
            (c, m) for c in range(2) for m in range(3)
        ]
        assert ops[-1].kind == OpKind.WAIT_SENDS


# ---------------------------------------------------------------------------------------------
# the engine, real ranks

STEPS, MICRO_BATCHES = 3, 4
PRECISIONS = ("", "+bf16", "+bf16+zero1")


def _max_diff(a, b):
    """Largest difference over every parameter of ``b`` (layers without parameters left out)."""
    assert [i for i in sorted(a) if a[i]] == [i for i in sorted(b) if b[i]]
    return max((a[i][k] - b[i][k]).abs().max().item() for i in b for k in b[i])


@pytest.mark.distributed
def test_interleaved_engines_exact(tmp_path):
    """2 stages x 2 replicas, tied embedding: interleaved-1f1b (v=2) is bit-identical to stock
    1F1B (parameters, losses, eval loss) in every precision, zb-v within rounding (its tied
    module is one parameter on stage 0: test_zb_v_exact checks it bit for bit untied); hippie-interleaved matches the
    reference of its rule in fp32 and keeps its replicas and tied copies identical in bf16 + ZeRO-1."""
    engines = (
        [f"{name}{p}" for p in PRECISIONS for name in ("stock", "interleaved-1f1b", "zb-v")]
        + [f"hippie-interleaved{p}" for p in PRECISIONS]
        + ["interleaved-1f1b+recompute", "zb-v+recompute"]
    )
    rc, log, _ = launch(
        4,
        tmp_path,
        "--stages",
        2,
        "--micro-batches",
        MICRO_BATCHES,
        "--steps",
        STEPS,
        "--tied",
        "--eval",
        "--engines",
        ",".join(engines),
        timeout=1500,
    )
    assert rc == 0, log[-4000:]
    for p in PRECISIONS:
        stock, stock_losses, _, _, _ = collect(tmp_path, f"stock{p}")
        ours, losses, parts, _, replicas = collect(tmp_path, f"interleaved-1f1b{p}")
        assert len(parts) == 4  # 2 stages x 2 chunks
        assert _max_diff(stock, ours) == 0.0, f"interleaved-1f1b{p} differs from stock"
        assert losses == stock_losses
        evals = {
            torch.load(f)["eval"]
            for name in (f"stock{p}", f"interleaved-1f1b{p}")
            for f in (tmp_path / name).glob("rank*.pt")
        }
        assert len(evals) == 1, f"eval_batch{p}: {evals}"
    for p in PRECISIONS:  # zb-v: the tied embedding and head are one parameter on stage 0
        stock, stock_losses, _, _, _ = collect(tmp_path, f"stock{p}")
        ours, losses, parts, _, _ = collect(tmp_path, f"zb-v{p}")
        assert len(parts) == 4 and _max_diff(stock, ours) <= (1e-6 if not p else 2**-8), f"zb-v{p}"
    ours, losses, parts, params, replicas = collect(tmp_path, "hippie-interleaved")
    assert params["deferred_stages"] == [0, 1]  # stage 0, and stage 1's tied copy (one rule for the tie)
    ref, ref_losses = reference.run(
        reference.interleaved_stages(parts, 2),
        2,
        MICRO_BATCHES,
        STEPS,
        deferred=[0, 1],
        delayed_layers={1: 0},
        staleness=StalenessConfig(),
        tied=True,
    )
    assert _max_diff(ours, ref) <= 1e-6
    assert _max_diff(ours, collect(tmp_path, "stock")[0]) > 1e-4  # the delayed rule is in effect
    for name in ("interleaved-1f1b+recompute", "zb-v+recompute"):  # per-layer re-computation, each chunk
        ours, losses, _, _, _ = collect(tmp_path, name)
        assert _max_diff(ours, collect(tmp_path, name.split("+")[0])[0]) == 0.0, name
    for name in (f"hippie-interleaved{p}" for p in PRECISIONS):
        files = [torch.load(f) for f in sorted((tmp_path / name).glob("rank*.pt"))]
        copies = [f["tied"]["tied"]["weight"] for f in files]
        assert all(torch.equal(c, copies[0]) for c in copies), f"{name}: tied copies differ"
        _, _, _, _, replicas = collect(tmp_path, name)
        assert _max_diff(replicas[0], replicas[1]) == 0.0


SEQFIRST = ("1f1b", "zb-h1", "hippie-zb+sync", "zb-v")  # the first: the others' baseline
# zb-v's 4 chunks cut the sequence-first model where 1f1b's 2 stages do not. A gradient received at a
# cut is contiguous (SEQ, B, W); inside one stage's graph it is the transposed view of a (B, SEQ, W)
# tensor, and the bias gradient then sums (B, SEQ) in another memory order. Measured after 3 steps:
# 0 on the Intel Xeons, 2.3e-10 (layer 1's bias) on AMD EPYC; zb-v equals interleaved-1f1b (the same
# cuts) bit for bit on both.
ZB_V_SEQFIRST = 1e-9


@pytest.mark.distributed
def test_zb_v_exact_and_chunk_allreduce(tmp_path):
    """2 stages x 2 replicas, untied. zb-v (V-shape, split backward, local hand-over at the last
    stage, the first stage loading inputs and labels and computing the loss) is bit-identical to
    stock 1F1B in every precision (fp32 + ZeRO-1 too), and its eval_batch gives stock's loss.
    hippie-interleaved's in-step stage 1 all-reduces chunk 1 early (start_allreduce(chunk)): it
    still matches the reference of the rule, replicas identical, in fp32 (with ZeRO-1's
    DeepSpeedZeroOptimizer too) and bf16 + ZeRO-1.
    Sequence-first activations (model.seqfirst_layer_specs: every stage boundary right after
    ``x.transpose(0, 1).contiguous()``, as Megatron-style stacks hand them on): zb-h1, hippie-zb
    (no deferred stage: the synchronous rule) and zb-v bit-identical to 1f1b in fp32 and bf16 +
    ZeRO-1 (their split backward's input gradient had the transposed strides, which the send of
    zb-h1's first ISendGrad refused: "input tensor has to be contiguous")."""
    seqfirst = [f"{name}+seqfirst{p}" for p in ("", "+bf16+zero1") for name in SEQFIRST] + ["interleaved-1f1b+seqfirst"]
    engines = (
        [f"{name}{p}" for p in PRECISIONS + ("+zero1",) for name in ("stock", "zb-v")]
        + ["hippie-interleaved", "hippie-interleaved+bf16+zero1", "hippie-interleaved+zero1"]
        + seqfirst
    )
    rc, log, _ = launch(
        4,
        tmp_path,
        "--stages",
        2,
        "--micro-batches",
        MICRO_BATCHES,
        "--steps",
        STEPS,
        "--eval",
        "--engines",
        ",".join(engines),
        timeout=1500,
    )
    assert rc == 0, log[-4000:]
    ours, losses, parts, params, replicas = collect(tmp_path, "hippie-interleaved")
    assert params["deferred_stages"] == [0]
    ref, _ = reference.run(
        reference.interleaved_stages(parts, 2), 2, MICRO_BATCHES, STEPS, deferred=[0], staleness=StalenessConfig()
    )
    assert _max_diff(ours, ref) <= 1e-6
    # SGD: a flat partition's zero gradient (ZeRO-1) changes nothing, the fp32 reference holds
    assert _max_diff(collect(tmp_path, "hippie-interleaved+zero1")[0], ref) <= 1e-6
    for name in ("hippie-interleaved", "hippie-interleaved+bf16+zero1", "hippie-interleaved+zero1"):
        _, _, _, _, replicas = collect(tmp_path, name)
        assert _max_diff(replicas[0], replicas[1]) == 0.0, name
    for p in PRECISIONS + ("+zero1",):  # fp32 + ZeRO-1: DeepSpeedZeroOptimizer
        stock, stock_losses, _, _, _ = collect(tmp_path, f"stock{p}")
        ours, losses, parts, _, _ = collect(tmp_path, f"zb-v{p}")
        assert len(parts) == 4
        assert _max_diff(stock, ours) == 0.0, f"zb-v{p} differs from stock"
        assert losses == stock_losses
        evals = {
            torch.load(f)["eval"] for name in (f"stock{p}", f"zb-v{p}") for f in (tmp_path / name).glob("rank*.pt")
        }
        assert len(evals) == 1, f"eval_batch{p}: {evals}"
    for p in ("", "+bf16+zero1"):
        base, base_losses, _, _, _ = collect(tmp_path, f"1f1b+seqfirst{p}")
        for name in SEQFIRST[1:]:
            ours, losses, parts, params, replicas = collect(tmp_path, f"{name}+seqfirst{p}")
            assert losses == base_losses, f"{name}+seqfirst{p}: losses differ from 1f1b"
            diff = _max_diff(base, ours)
            if name == "zb-v":  # 4 chunks: cuts 1f1b does not have (docs/precision.md, "zb-v on sequence-first")
                print(f"zb-v+seqfirst{p}: |zb-v - 1f1b| = {diff:.3g}")
                assert diff <= ZB_V_SEQFIRST, f"zb-v+seqfirst{p} differs from 1f1b by {diff:.3g}"
            else:
                assert diff == 0.0, f"{name}+seqfirst{p} differs from 1f1b by {diff:.3g}"
            assert _max_diff(replicas[0], replicas[1]) == 0.0
            assert len(parts) == (4 if name == "zb-v" else 2) and params.get("deferred_stages", []) == []
    # where the cuts are the same, bit-identical on every CPU: zb-v's V against interleaved-1f1b's loop
    same_cuts, same_losses, *_ = collect(tmp_path, "interleaved-1f1b+seqfirst")
    ours, losses, *_ = collect(tmp_path, "zb-v+seqfirst")
    assert _max_diff(same_cuts, ours) == 0.0 and losses == same_losses, "zb-v+seqfirst differs from interleaved-1f1b"


@pytest.mark.distributed
def test_checkpoints_cross_layouts(tmp_path):
    """interleaved-1f1b saves after 2 steps; 1f1b resumes from its per-layer files and the third
    step lands bit-identical to stock's uninterrupted run; likewise 1f1b into zb-v's V layout, to
    rounding (its tied embedding and head are one parameter: see above)."""
    common = ("--stages", 2, "--micro-batches", MICRO_BATCHES, "--tied")
    rc, log, _ = launch(2, tmp_path / "full", *common, "--steps", STEPS, "--engines", "stock", timeout=300)
    assert rc == 0, log[-4000:]
    stock, stock_losses, _, _, _ = collect(tmp_path / "full", "stock")
    # one direction per layout (CI time: two launches a pair); the other directions ran here until b08451a
    for first, second in (("interleaved-1f1b", "1f1b"), ("1f1b", "zb-v")):
        out = tmp_path / f"{first}-to-{second}"
        rc, log, _ = launch(2, out, *common, "--steps", STEPS, "--checkpoint-at", 2, "--engines", first, timeout=300)
        assert rc == 0, log[-4000:]
        rc, log, _ = launch(
            2,
            out,
            *common,
            "--steps",
            STEPS,
            "--resume",
            out / first / "ckpt",
            "--resume-weights-only",
            "--engines",
            second,
            timeout=300,
        )
        assert rc == 0, log[-4000:]
        ours, losses, _, _, _ = collect(out, second)
        if "zb-v" in (first, second):
            assert _max_diff(stock, ours) <= 1e-6, f"{first} -> {second}"
            assert losses["rank1"] == pytest.approx(stock_losses["rank1"][2:], abs=1e-6)
        else:
            assert _max_diff(stock, ours) == 0.0, f"{first} -> {second}"
            assert losses["rank1"] == stock_losses["rank1"][2:]


@pytest.mark.distributed
def test_megatron_shapes_under_virtual_stages(tmp_path):
    """The Megatron-shaped client (3-D activations, views as stage outputs, a tied embedding with
    a parameter unused on the head's stage): interleaved-1f1b bit-identical to stock in fp32 and
    bf16 + ZeRO-1, zb-v within rounding (its V puts the tied embedding and head on stage 0 as one
    parameter, whose two gradients then sum in another order: equal or one rounding apart
    depending on the CPU's vector width), hippie-interleaved trains with identical replicas."""
    names = ("stock", "interleaved-1f1b", "zb-v", "hippie-interleaved")
    engines = [f"{n}{p}" for p in ("", "+bf16+zero1") for n in names]
    rc, log, _ = launch(
        4,
        tmp_path,
        "--stages",
        2,
        "--micro-batches",
        MICRO_BATCHES,
        "--steps",
        STEPS,
        "--megatron",
        "--engines",
        ",".join(engines),
        timeout=1500,
    )
    assert rc == 0, log[-4000:]
    for p in ("", "+bf16+zero1"):
        stock, stock_losses, _, _, _ = collect(tmp_path, f"stock{p}")
        ours, losses, _, _, _ = collect(tmp_path, f"interleaved-1f1b{p}")
        assert _max_diff(stock, ours) == 0.0 and losses == stock_losses, f"interleaved-1f1b{p}"
        ours, losses, _, _, _ = collect(tmp_path, f"zb-v{p}")
        tol = 1e-6 if not p else 2**-8
        assert _max_diff(stock, ours) <= tol, f"zb-v{p}"
        assert all(
            abs(x - y) <= tol * max(1.0, abs(y)) for r in stock_losses for x, y in zip(losses[r], stock_losses[r])
        ), f"zb-v{p} losses"
        ours, losses, _, _, replicas = collect(tmp_path, f"hippie-interleaved{p}")
        assert _max_diff(replicas[0], replicas[1]) == 0.0
        assert all(loss == loss and abs(loss) < 100 for rank in losses.values() for loss in rank)


def test_cli_takes_virtual_stages(capsys):
    from hippie_ds.cli import main

    assert main(["schedule", "simulate", "interleaved-1f1b", "-K", "4", "-M", "8", "--virtual-stages", "4"]) == 0
    assert "bubble 8.6%" in capsys.readouterr().out  # (K-1)/(vM+K-1) = 3/35
    assert main(["schedule", "validate", "1f1b", "-K", "4", "-M", "8", "-v", "2"]) == 1
    assert "schedule '1f1b' runs one model chunk per stage" in capsys.readouterr().out
