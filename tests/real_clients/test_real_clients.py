"""Every schedule on a client in Megatron-DeepSpeed's shape (tests/distributed/megatron_shaped.py:
a parameterless first layer, a tied embedding whose last-stage copy leaves a parameter unused,
two parameter groups, a scheduler whose ``step`` needs an argument, clipping, a loop that never
calls ``drain()``), 2 stages x 2 replicas, in fp32, bf16 + ZeRO-1 (BF16_Optimizer), and bf16 + ZeRO-1
without ``data_types`` and fp32 + ZeRO-1 (DeepSpeedZeroOptimizer). Each trait crashed some
schedule at its first step once. One launch per precision runs every engine in turn.

Synchronous schedules must be bit-identical to stock DeepSpeed; the others must train with every
copy of the tied embedding equal, and step the client's scheduler as stock does.
"""

import math
from pathlib import Path

import pytest
import torch

from launch import launch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parents[1] / "distributed" / "megatron_shaped.py"
SYNCHRONOUS = ["1f1b", "gpipe", "zb-h1"]
# +all: hippie.deferred_layers "all" (clipping + tie group + whole-stage deferral);
# +drain: drain() after the last step (bf16 + clipping + tie: the tied copy's step alone)
# hippie: the default deferral ("untied": the first block, not the tied embedding); hippie+1: exactly one
# layer with parameters, the tied embedding (and so the head's copy)
OTHERS = {
    "fp32": ["hippie", "hippie+1", "hippie-1f1b", "hippie-zb", "pipedream+drain", "2bw+drain", "hippie+all+drain"],
    "bf16-zero1": ["hippie+drain", "hippie-1f1b", "2bw+drain", "pipedream+drain", "hippie+all+drain"],
    # ZeRO-1 as users write it (fp32, or bf16 without data_types): DeepSpeedZeroOptimizer (ds/zero.py)
    # hippie+drain: drain() steps the partition for the delayed block alone; the in-step tied embedding
    # stays put on stage 0 too (ds.zero.ZeroUnmoved; without it the copies part by 0.0156 in bf16)
    "bf16-plain-zero1": ["hippie+drain", "hippie-1f1b", "2bw+drain"],
    "fp32-zero1": ["hippie+drain", "hippie-1f1b", "2bw+drain"],
}
STEPS = 4
# hippie.profile: the job profiles itself (virtual stages, tuples between stages, a lambda, a tied
# forward_fn) in this launch, next to the same engine without the key
PROFILED = ["fp32:interleaved-1f1b+tuple", "fp32:interleaved-1f1b+tuple+profile"]
# the drop-in: a subclass of hippie_ds.PipelineModule built without config= (as Megatron builds
# GPTModelPipe), the config in sys.argv (--deepspeed_config PATH; +b64: base64 JSON); weights drawn per
# global layer (layout-independent). Also DeepSpeed's unit-test models (ds_unit_models.py) so built.
DROP_IN = {
    "megatron": ["1f1b+argv", "interleaved-1f1b+argv", "zb-v+b64", "hippie-interleaved+argv+drain"],
    "linearstack": ["1f1b", "interleaved-1f1b", "zb-v"],
    "alexnet": ["1f1b", "interleaved-1f1b", "zb-v"],
}
DROP_IN_ENGINES = [
    f"fp32:{n}" if model == "megatron" else f"fp32:{n}+{model}" for model, names in DROP_IN.items() for n in names
]
# a planner plan for interleaved-1f1b (model chunks, boundaries, re-computed layers), named only by "hippie.plan"
# in the config in sys.argv, which names no schedule (megatron_shaped.chunked_plan)
PLANNED = "fp32:interleaved-1f1b+argv+plan"


def _load(out, name):
    return [torch.load(f) for f in sorted(Path(out, name).glob("rank*.pt"))]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch, every precision's engines in turn (each launch costs ~15 s of start-up)."""
    out = tmp_path_factory.mktemp("clients")
    engines = (
        [f"{p}:{name}" for p in sorted(OTHERS) for name in ["stock", *SYNCHRONOUS, *OTHERS[p]]]
        + PROFILED
        + DROP_IN_ENGINES
        + [PLANNED]
    )
    rc, log, _ = launch(4, out, "--steps", STEPS, "--engines", ",".join(engines), worker=WORKER, timeout=2400)
    assert rc == 0, log[-5000:]
    assert "terminate called" not in log, log[-3000:]
    return out, log


@pytest.fixture(params=sorted(OTHERS))
def matrix(request, launched):
    out, log = launched
    precision = request.param
    names = ["stock", *SYNCHRONOUS, *OTHERS[precision]]
    return precision, {name: _load(out, f"{precision}:{name}") for name in names}, log


def _ranks_by_stage(ranks):
    return {(r["stage"], r["replica"]): r for r in ranks}


def test_synchronous_schedules_are_bit_identical_to_stock(matrix):
    _, runs, _ = matrix
    stock = _ranks_by_stage(runs["stock"])
    for name in SYNCHRONOUS:
        got = _ranks_by_stage(runs[name])
        assert got.keys() == stock.keys()
        for key, ref in stock.items():
            assert got[key]["losses"] == ref["losses"], (name, key)
            for layer, state in ref["layers"].items():
                for k, v in state.items():
                    assert torch.equal(got[key]["layers"][layer][k], v), (name, key, layer, k)


def test_every_schedule_trains_with_tied_copies_equal_and_the_clients_scheduler(matrix):
    """Tied copies: every holder and replica ends with the same word embedding (2bw, whose tie
    sum lags by an update, and pipedream, after drain()). The scheduler is stepped as stock steps it: with the samples
    of the step when ``step()`` needs an argument."""
    _, runs, _ = matrix
    stock = runs["stock"][0]
    for name, ranks in runs.items():
        first = ranks[0]["losses"]
        assert all(math.isfinite(x) for x in first), name
        assert first[-1] < first[0], (name, first)
        copies = [r["tied"]["embed"] for r in ranks]
        assert all(torch.equal(c, copies[0]) for c in copies), (
            name,
            [float((c - copies[0]).abs().max()) for c in copies],
        )
        assert [r["lr"] for r in ranks] == [stock["lr"]] * len(ranks), name
        assert all(r["global_steps"] == STEPS for r in ranks), name


def test_a_loop_that_never_drains_is_told_at_exit(launched):
    """Nothing requires drain() (Megatron never calls it); a process that exits with updates in
    flight says so once per stage, and one that drained says nothing."""
    _, log = launched
    warned = {
        line.split("schedule ")[1].split()[0].strip("'")
        for line in log.splitlines()
        if "not applied to the weights in memory" in line
    }
    undrained = {name.split("+")[0] for names in OTHERS.values() for name in names if "drain" not in name}
    assert warned == undrained, (warned, undrained)


def test_the_job_profiles_itself_in_place_for_the_planner(launched, tmp_path):
    """``hippie.profile``: 2 stages x 2 replicas x 2 model chunks measure every layer in place
    (after a warm-up call, during 2 train_batch calls); rank 0 writes one profile that names the
    model's layers in global order with its fingerprint, with the real output and parameter
    bytes, and ``hippie-ds plan`` plans from it. Training is bit-identical to the run without the key."""
    from hippie_ds.adapter.profiling.layer_timing import nbytes
    from hippie_ds.adapter.module.pipeline_module import layer_names, model_fingerprint
    from hippie_ds.cli import main
    from hippie_ds.planner import load_plan, load_profile
    from hippie_ds.profiler import build_layers

    import megatron_shaped as client

    out, log = launched
    plain, profiled = (_ranks_by_stage(_load(out, name)) for name in PROFILED)
    assert plain.keys() == profiled.keys() and len(plain) == 4
    for key, ref in plain.items():
        assert profiled[key]["losses"] == ref["losses"], key
        assert ref["layers"].keys() == profiled[key]["layers"].keys() and ref["layers"], key
        for layer, state in ref["layers"].items():
            for k, v in state.items():
                assert torch.equal(profiled[key]["layers"][layer][k], v), (key, layer, k)
        assert torch.equal(profiled[key]["tied"]["embed"], ref["tied"]["embed"]), key

    path = Path(out, PROFILED[1], "profile.yaml")
    assert "hippie-ds: profile step 2/2" in log and f"wrote {path}" in log
    profile = load_profile(path)
    specs = client.tuple_specs(4)  # the worker's default --blocks
    assert [x.name for x in profile.layers] == layer_names(specs)
    assert "<lambda>" in layer_names(specs) and profile.fingerprint() == model_fingerprint(specs)
    assert profile.batch_size == client.MICRO
    # the real activations at every cut and the real parameters, in one process
    funcs, params = build_layers(specs)
    x = next(client.data(0, 1))[0]
    assert profile.layers[0].input_bytes == nbytes(x)
    tuples = 0
    with torch.no_grad():
        for i, (layer, fn, ps) in enumerate(zip(profile.layers, funcs, params)):
            x = fn(x)
            tuples += isinstance(x, tuple)
            assert layer.output_bytes == nbytes(x), (i, layer.name)
            assert layer.param_bytes == sum(p.numel() * p.element_size() for p in ps), (i, layer.name)
            assert layer.forward > 0 and layer.backward >= 0 and 0 <= layer.backward_weight <= layer.backward
            assert layer.saved_bytes >= 0
            if not callable(getattr(specs[i], "build", None)):  # a function or lambda: no parameters
                assert layer.param_bytes == 0 and layer.backward_weight == 0, (i, layer.name)
            elif ps:
                assert layer.backward > 0, (i, layer.name)
    assert tuples == 5  # _with_positions and the four blocks pass (hidden, positions)
    embed, logits = profile.layers[1], profile.layers[-1]
    assert embed.backward_weight == embed.backward > 0  # token ids need no gradient: all of it is W
    assert embed.param_bytes > 0 and logits.param_bytes == 0  # the tied module counts at its first use
    # the loss, measured on the last stage like a layer but not one of them (names, fingerprint above)
    loss, labels = profile.loss, next(client.data(0, 1))[1]
    assert loss is not None and loss.name == "loss_fn" and loss.forward > 0 and loss.backward > 0
    assert loss.backward_weight == 0 and loss.param_bytes == 0
    assert loss.input_bytes == logits.output_bytes + nbytes(labels)
    assert loss.saved_bytes >= logits.output_bytes  # cross_entropy's fp32 log_softmax, as large as the logits
    assert loss.working_bytes is None and all(x.working_bytes is None for x in profile.layers)  # the CPU: estimated
    assert (profile.param_dtype, profile.param_bytes_dtype, profile.state_factor()) == ("float32", "float32", 4.0)
    # the job's shape, the four blocks as one group and the machine's load
    from hippie_ds.planner.profile_fields import JobShape

    assert profile.job == JobShape(
        stages=2, data_parallel=2, micro_batch_size=client.MICRO, global_batch=client.MICRO * 4 * 2, virtual_stages=2
    )
    blocks = [i for i, name in enumerate(layer_names(specs)) if name == "TupleBlock"]
    assert profile.groups == [blocks] and len(blocks) == 4
    assert len({(profile.layers[i].forward, profile.layers[i].backward) for i in blocks}) == 1
    assert all(profile.layers[i].own_ratio > 0 and profile.layers[i].spread >= 0 for i in blocks)
    assert profile.load.cpus >= 1 and profile.load.cpu_share > 0 and profile.load.load_before >= 0

    plan_path = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--profile",
                str(path),
                "--cluster",
                "1x4,1GB,10Gbit",
                "--global-batch",
                "16",
                "--out",
                str(plan_path),
            ]
        )
        == 0
    )
    plan = load_plan(plan_path)
    assert plan.fingerprint == model_fingerprint(specs)
    # the loss's working memory (estimated: its input's gradient) is on the last stage's peak
    scale = plan.micro_batch_size / profile.batch_size
    assert plan.stages[-1].working_memory >= scale * profile.loss_working() > 0


def _same(a, b, tol=0.0):
    """The largest difference between runs ``a`` and ``b`` over every layer of every replica
    (all model chunks), wherever each layout holds it."""

    def held(ranks):
        return {(r["replica"], layer): state for r in ranks for layer, state in r["layers"].items()}

    ref, got = held(a), held(b)
    assert ref.keys() == got.keys()
    return max((got[key][k] - v).abs().max().item() for key, state in ref.items() for k, v in state.items())


def test_drop_in_module_takes_the_config_from_sys_argv(launched):
    """``from hippie_ds import PipelineModule`` as the base class of a model built without config=
    (Megatron's GPTModelPipe; DeepSpeed's LinearStackPipe and AlexNetPipeSpec): the module finds the
    config in sys.argv (a path; base64), says so on rank 0, builds the schedule's model chunks, and
    interleaved-1f1b and zb-v are bit-identical to 1f1b from the same layout-independent weights on
    DeepSpeed's models, within rounding on the GPT (see below); hippie-interleaved trains with its
    tied copies and replicas equal. Nothing in
    sys.argv: the subclass is DeepSpeed's class (same partition, same weights)."""
    out, log = launched
    for r in _load(out, "no-config"):
        assert r["same"] and r["chunks"] == 1 and r["source"] is None, r
    assert "PipelineModule built without config=, from the DeepSpeed config --deepspeed_config " in log
    assert "from the DeepSpeed config --deepspeed_config <base64 JSON> (sys.argv): schedule 'zb-v'" in log
    for model, names in DROP_IN.items():
        suffix = "" if model == "megatron" else f"+{model}"
        runs = {n.split("+")[0]: _load(out, f"fp32:{n}" if model == "megatron" else f"fp32:{n}{suffix}") for n in names}
        ref = runs["1f1b"]

        def stage0(ranks):
            return sorted(next(r for r in ranks if r["stage"] == 0)["layers"])

        for name in ("interleaved-1f1b", "zb-v"):
            assert stage0(runs[name]) != stage0(ref), (model, name)  # two model chunks per stage: another layout
            # the GPT: 2.4e-7 (interleaved-1f1b) and 1.5e-6 (zb-v) apart after 4 steps on this CPU, first
            # seen in step 3's loss (one ulp); cause not yet found (clipping off changes nothing; the
            # train_worker GPT of test_virtual_stages is exact). DeepSpeed's own models: bit for bit.
            tol = 1e-5 if model == "megatron" else 0.0
            assert _same(ref, runs[name]) <= tol, (model, name)
            losses, ref_losses = (_ranks_by_stage(r) for r in (runs[name], ref))
            assert all(
                x == pytest.approx(y, abs=tol)
                for key in ref_losses
                for x, y in zip(losses[key]["losses"], ref_losses[key]["losses"])
            ), (model, name)
        if model == "megatron":
            ranks = runs["hippie-interleaved"]
            copies = [r["tied"]["embed"] for r in ranks]
            assert all(torch.equal(c, copies[0]) for c in copies)
            by = _ranks_by_stage(ranks)
            for stage in (0, 1):
                assert by[stage, 0]["layers"].keys() == by[stage, 1]["layers"].keys()
                assert all(
                    torch.equal(v, by[stage, 1]["layers"][i][k])
                    for i, state in by[stage, 0]["layers"].items()
                    for k, v in state.items()
                ), stage
            first = ranks[0]["losses"]
            assert all(math.isfinite(x) for x in first) and first[-1] < first[0], first


def test_a_chunked_plan_in_the_config_trains_as_1f1b(launched):
    """A plan for interleaved-1f1b, 2 stages x 2 model chunks, applied through ``"hippie": {"plan": ...}``
    to the drop-in module built without config= (the config in sys.argv names no schedule): every rank
    holds the plan's model parts and re-computed layers, not DeepSpeed's 'type:Block' cut, and training
    matches 1f1b on DeepSpeed's default partition from the same layout-independent weights (the GPT's
    tolerance above)."""
    from megatron_shaped import PLAN_BOUNDARIES, PLAN_CHECKPOINTED

    out, log = launched
    ref, ranks, default = (_load(out, name) for name in ("fp32:1f1b+argv", PLANNED, "fp32:interleaved-1f1b+argv"))
    assert len(ranks) == 4 and {(r["stage"], r["replica"]) for r in ranks} == {(s, d) for s in (0, 1) for d in (0, 1)}
    for r in ranks:
        assert (r["parts"], r["chunks"], r["checkpointed"]) == (PLAN_BOUNDARIES, (2, "interleaved"), PLAN_CHECKPOINTED)
        held = {0: [1, 3, 4], 1: [2, 5, 6]}[r["stage"]]  # parts 0, 2 and 1, 3 (layers 0 and 7 hold no own weights)
        assert sorted(r["layers"]) == held, r["stage"]
    assert all(r["parts"] != PLAN_BOUNDARIES and r["checkpointed"] == [] for r in ref + default)
    assert (
        "(sys.argv): the plan for 'megatron-shaped' (schedule 'interleaved-1f1b': 2 model chunks per stage "
        f"(interleaved layout); boundaries {PLAN_BOUNDARIES})" in log
    )
    assert f"model-part boundaries {PLAN_BOUNDARIES} and checkpointed layers {PLAN_CHECKPOINTED} from the plan" in log
    assert _same(ref, ranks) <= 1e-5
    losses, ref_losses = _ranks_by_stage(ranks), _ranks_by_stage(ref)
    assert all(
        x == pytest.approx(y, abs=1e-5)
        for key in ref_losses
        for x, y in zip(losses[key]["losses"], ref_losses[key]["losses"])
    )
    copies = [r["tied"]["embed"] for r in ranks]
    assert all(torch.equal(c, copies[0]) for c in copies)


def test_the_default_deferral_keeps_the_tied_embedding_in_step(launched):
    """hippie's default (``deferred_layers: "untied"``) on Megatron's shape delays stage 0's first
    block, not the word embedding tied to the head: after step 1 (where a deferred stage has
    nothing buffered to apply) every copy of the embedding took stock's update (up to the
    per-stage clipping's rounding) while the first block has not moved; the second block took
    stock's update. ``hippie+1`` delays exactly one layer with parameters, the tied embedding, so
    every copy of it (the head's too) is still where it started."""
    out, _ = launched
    stock, default, one = (_ranks_by_stage(_load(out, f"fp32:{name}")) for name in ("stock", "hippie", "hippie+1"))
    for key, ref in stock.items():
        start, first = ref["start"][1]["embed"], ref["first"][1]["embed"]
        moved = float((first - start).abs().max())
        assert moved > 0, key
        assert torch.equal(default[key]["start"][1]["embed"], start), key  # the same initial weights
        assert float((default[key]["first"][1]["embed"] - first).abs().max()) <= 1e-3 * moved, key
        assert torch.equal(one[key]["first"][1]["embed"], start), key
    for replica in (0, 1):
        ref, ours = stock[(0, replica)], default[(0, replica)]
        for block, delayed in ((2, True), (3, False)):  # layers: _to_float, embedding, block, block
            w0, w1 = ref["start"][0][block]["fc.weight"], ref["first"][0][block]["fc.weight"]
            got = ours["first"][0][block]["fc.weight"]
            assert not torch.equal(w0, w1)
            if delayed:
                assert torch.equal(got, w0), (replica, block)
            else:
                assert float((got - w1).abs().max()) <= 1e-3 * float((w1 - w0).abs().max()), (replica, block)
