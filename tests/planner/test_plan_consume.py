"""Profile -> plan -> train: the profiler's measurements, the plan driving a real 2-rank
DeepSpeed job (stage boundaries and per-layer re-computation), and the planner's predicted
activation memory against the bytes the job actually held for backward."""

import json
from pathlib import Path

import pytest
import torch

from hippie_ds.config import ConfigError, merge_plan
from hippie_ds.adapter.profiling.memory import ActivationMeter
from hippie_ds.adapter.module.pipeline_module import check_plan, layer_names, recompute_runs, model_fingerprint
from hippie_ds.planner import load_profile, make_plan, parse_cluster, save_plan
from hippie_ds.planner.plan_file import PlanMismatchError
from hippie_ds.planner.recompute import activations_of
from hippie_ds.profiler import build_layers, load_target, profile_layers

import plan_model
from launch import launch

WORKER = Path(__file__).resolve().parents[1] / "distributed" / "plan_worker.py"
CLUSTER = "1x2,1GB,10Gbit"
GLOBAL_BATCH = 256  # 8 micro-batches of 32 on one replica


@pytest.fixture(scope="module")
def profile():
    layers, sample, name = load_target(f"{Path(plan_model.__file__)}:profile_target")
    return profile_layers(layers, sample, model=name, repeats=3, warmup=1)


def test_profile_measures_what_a_sequential_run_holds(profile):
    specs = plan_model.layer_specs()
    assert [x.name for x in profile.layers] == layer_names(specs)
    assert profile.batch_size == plan_model.MICRO_BATCH_SIZE
    funcs, params = build_layers(specs)
    assert [x.param_bytes for x in profile.layers] == [4.0 * sum(p.numel() for p in ps) for ps in params]
    assert profile.fingerprint() == model_fingerprint(specs)
    assert all(x.forward > 0 and x.backward > 0 for x in profile.layers)
    # Producer attribution: the layers' saved bytes plus the input are exactly what a whole
    # forward of the chain holds for backward (saved tensors, the input and the output).
    model = torch.nn.Sequential(*funcs)
    meter = ActivationMeter(model)
    x = plan_model.sample()
    with meter:
        meter.hold(x)
        out = model(x)
        meter.hold(out)
    total = profile.layers[0].input_bytes + sum(x.saved for x in profile.layers)
    assert meter.peak == total
    out.sum().backward()


def test_profile_target_errors(tmp_path):
    from hippie_ds.planner.profile import ProfileError

    with pytest.raises(ProfileError, match="expected module:function"):
        load_target("plan_model")
    with pytest.raises(ProfileError, match="has no function 'nope'"):
        load_target(f"{Path(plan_model.__file__)}:nope")
    bad = tmp_path / "bad.py"
    bad.write_text("def target():\n    return 3\n")
    with pytest.raises(ProfileError, match=r"must return \(layers, sample\)"):
        load_target(f"{bad}:target")


def _even_times(profile):
    """``profile`` with every layer at 1 ms forward and 2 ms backward: the plan's boundaries then
    follow the measured bytes, not this machine's timing noise (with the measured times the plan
    cut after layer 4, 5 or 6 from run to run). Known gap, left open: DeepSpeed keeps the buffer a
    stage received until the backward and runs the stage on a clone of it. The model counts that
    input once; the meter counts the clone, so where the first layer does not save its input (a
    cut after layer 6: Tanh saves its output) it misses the buffer (827392 B measured, 1052672 B
    predicted), and where the first layer does save it, both miss the second copy."""
    return profile.model_copy(
        update={"layers": [x.model_copy(update={"forward": 1e-3, "backward": 2e-3}) for x in profile.layers]}
    )


def _plans(profile, tmp_path):
    profile = _even_times(profile)
    cluster = parse_cluster(CLUSTER)
    kw = dict(
        objective="throughput",
        depths=[2],
        micro_batch_sizes=[plan_model.MICRO_BATCH_SIZE],
        schedules=["gpipe"],
        baselines=False,
    )
    plain = make_plan(profile, cluster, GLOBAL_BATCH, **kw)
    recompute = make_plan(profile, cluster, GLOBAL_BATCH, memory_cap=plain.prediction.memory_max * 0.95, **kw)
    assert not plain.checkpointed_layers and recompute.checkpointed_layers
    out = []
    for name, plan in (("plain", plain), ("recompute", recompute)):
        save_plan(plan, tmp_path / f"{name}.json")
        cfg = {
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
            "steps_per_print": 10_000,
            "hippie": {"plan": f"{name}.json"},
        }  # relative to the config file
        (tmp_path / f"{name}-config.json").write_text(json.dumps(cfg))
        out.append((plan, tmp_path / f"{name}-config.json"))
    return out


def predicted_activations(profile, plan, stage):
    """The plan's figure, checked against the memory model written out for this stage."""
    a, b = plan.boundaries[stage], plan.boundaries[stage + 1]
    layers = profile.layers
    stage_input = profile.cuts()[a - 1] if a > 0 else layers[0].input_bytes
    if not layers[b - 1].output_saved:
        stage_input += layers[b - 1].output_bytes  # the engine holds the stage output
    outs = [x.output_bytes if x.output_saved else 0.0 for x in layers[a:b]]
    ins = [0.0] + [0.0 if x.output_saved else x.output_bytes for x in layers[a : b - 1]]
    pred = activations_of(
        plan.checkpointed_layers,
        a,
        [x.saved for x in layers[a:b]],
        stage_input,
        plan.stages[stage].in_flight,
        outs,
        ins,
    )
    assert plan.stages[stage].activation_memory == pytest.approx(pred)
    return pred


@pytest.mark.distributed
def test_plan_drives_training_and_predicts_activation_memory(profile, tmp_path):
    plans = _plans(profile, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    code, log, seconds = launch(
        2, out, "--configs", ",".join(str(c) for _, c in plans), "--steps", "2", worker=WORKER, timeout=900
    )
    assert code == 0, log[-3000:]
    results, checks = {}, []
    for i, (plan, _) in enumerate(plans):
        for rank in range(2):
            r = torch.load(out / f"run{i}_rank{rank}.pt")
            assert r["parts"] == plan.boundaries
            assert r["checkpointed"] == plan.checkpointed_layers
            assert r["micro_batches"] == plan.micro_batches and r["schedule"] == plan.schedule
            pred = predicted_activations(profile, plan, r["stage"])
            measured = max(r["peaks"])
            print(
                f"plan {i} {plan.boundaries} stage {r['stage']}, {plan.stages[r['stage']].in_flight} in flight: "
                f"measured {measured} B, predicted {pred:.0f} B ({measured / pred - 1:+.1%}); "
                f"checkpointed {plan.checkpointed_layers}"
            )
            results[(i, rank)] = r
            checks.append((measured, pred))
    for measured, pred in checks:
        assert measured == pytest.approx(pred, rel=0.10)
    # Re-computation changes memory, not the arithmetic: same losses and parameters.
    last = max(r["stage"] for r in results.values())
    losses = [results[(i, r)]["losses"] for i in range(2) for r in range(2) if results[(i, r)]["stage"] == last]
    assert losses[0] == losses[1]
    states = [{k: v for r in range(2) for k, v in results[(i, r)]["states"].items()} for i in range(2)]
    assert states[0].keys() == states[1].keys()
    for layer in states[0]:
        for key, value in states[0][layer].items():
            assert torch.equal(value, states[1][layer][key]), (layer, key)
    # ... and it did change memory: the re-computing plan held less on the stages it re-computes
    # (which stage that is follows the measured layer times: it is not fixed).
    peaks = {(i, results[(i, r)]["stage"]): max(results[(i, r)]["peaks"]) for i in range(2) for r in range(2)}
    bounds, ckpt = plans[1][0].boundaries, plans[1][0].checkpointed_layers
    recomputing = [s for s in range(2) if any(bounds[s] <= i < bounds[s + 1] for i in ckpt)]
    assert recomputing
    for s in recomputing:
        assert peaks[(1, s)] < peaks[(0, s)], s


def test_plan_for_another_model_or_job_is_refused(profile, tmp_path):
    (plan, _), _ = _plans(profile, tmp_path)
    specs = plan_model.layer_specs()
    check_plan(plan, specs, world_size=2, num_stages=None)  # the right model and job
    with pytest.raises(PlanMismatchError, match="this job has 4"):
        check_plan(plan, specs, world_size=4, num_stages=None)
    with pytest.raises(PlanMismatchError, match="num_stages=4"):
        check_plan(plan, specs, world_size=2, num_stages=4)
    with pytest.raises(PlanMismatchError, match="10 layers; this model has 9"):
        check_plan(plan, specs[:-1], world_size=2, num_stages=None)
    from deepspeed.pipe import LayerSpec

    wider = specs[:-1] + [LayerSpec(torch.nn.Linear, plan_model.WIDTH, 8)]
    with pytest.raises(PlanMismatchError, match="another model"):
        check_plan(plan, wider, world_size=2, num_stages=None)


def test_plan_keys_merge_into_the_config(profile, tmp_path):
    (plan, _), _ = _plans(profile, tmp_path)
    keys = plan.deepspeed_config()
    merged = merge_plan({"optimizer": {}, "pipeline": {"schedule": plan.schedule}}, keys, "p.json")
    assert merged["train_batch_size"] == GLOBAL_BATCH and merged["pipeline"]["schedule"] == plan.schedule
    with pytest.raises(ConfigError, match='"train_batch_size" = 64, but the plan p.json'):
        merge_plan({"train_batch_size": 64}, keys, "p.json")
    with pytest.raises(ConfigError, match='"pipeline.schedule" = \'1f1b\''):
        merge_plan({"pipeline": {"schedule": "1f1b"}}, keys, "p.json")


def test_recompute_runs():
    assert recompute_runs([]) == []
    assert recompute_runs([4, 0, 1, 2, 6, 7]) == [(0, 3), (4, 5), (6, 8)]


def test_profile_cli_writes_a_profile_the_planner_reads(tmp_path):
    from hippie_ds.cli import main

    path = tmp_path / "p.yaml"
    assert (
        main(
            [
                "profile",
                f"{Path(plan_model.__file__)}:profile_target",
                "--out",
                str(path),
                "--repeats",
                "2",
                "--warmup",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    prof = load_profile(path)
    assert prof.num_layers == 10 and prof.model == "plan-mlp"
    assert (
        main(
            [
                "plan",
                "--profile",
                str(path),
                "--cluster",
                CLUSTER,
                "--global-batch",
                "256",
                "--out",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    assert main(["profile", "nope"]) == 2
