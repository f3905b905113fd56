"""Plans fit the job: a profile measured in place records the job's shape,
``hippie-ds plan`` keeps it unless told otherwise and says so, a plan of another shape prints the
changes the job needs, and the start-up refusal of a module whose stage count is not the plan's
names where the module got it (``topology=`` or ``num_stages=``) and the same changes. Pure: the
planner, the CLI in-process, and a model class shaped like Megatron-DeepSpeed's ``GPTModelPipe``
(it builds ``topology=`` from its own pipeline-size argument, never ``num_stages``) built without a
process group, where the plan check runs before DeepSpeed's constructor."""

import json
from types import SimpleNamespace

import pytest
import torch
from deepspeed.pipe import LayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

import hippie_ds
from cli_run import run
from hippie_ds.adapter.module import config_discovery
from hippie_ds.adapter.module.pipeline_module import layer_names, layer_param_bytes
from hippie_ds.planner import LayerProfile, PlanMismatchError, PlannerError, Profile, load_profile, make_plan
from hippie_ds.planner import parse_cluster, save_plan, save_profile
from hippie_ds.planner.job_shape import changes_from_job, keep_shape, shape_changes
from hippie_ds.planner.profile_fields import JobShape

HIDDEN, MICRO = 8, 4
JOB = JobShape(stages=2, data_parallel=2, micro_batch_size=MICRO, global_batch=16)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def specs():
    return [LayerSpec(Block) for _ in range(8)]


def loss_fn(out, labels):
    return ((out - labels) ** 2).mean()


class GPTModelPipe(hippie_ds.PipelineModule):
    """Megatron-DeepSpeed's shape: the pipeline size is the model's own argument, and the class passes
    ``topology=`` (never ``num_stages``) to the pipeline module it subclasses."""

    def __init__(self, pipeline_model_parallel_size, data_parallel_size):
        topology = PipeModelDataParallelTopology(
            num_pp=pipeline_model_parallel_size, num_mp=1, num_dp=data_parallel_size
        )
        super().__init__(layers=specs(), loss_fn=loss_fn, topology=topology, partition_method="type:Block")


def profile(job=JOB):
    layers = specs()
    return Profile(
        model="gpt-shaped",
        batch_size=MICRO,
        job=job,
        layers=[
            LayerProfile(
                name=n,
                forward=1e-3 * (1 + i % 3),
                backward=2e-3 * (1 + i % 3),
                output_bytes=4.0 * MICRO * HIDDEN,
                param_bytes=b,
            )
            for i, (n, b) in enumerate(zip(layer_names(layers), layer_param_bytes(layers)))
        ],
    )


@pytest.fixture(autouse=True)
def _no_config():
    config_discovery.set_config(None)
    yield
    config_discovery.set_config(None)


def test_the_planner_keeps_the_jobs_shape_unless_told_otherwise():
    kept = keep_shape(JOB, 4)
    assert (kept.depths, kept.micro_batch_sizes, kept.global_batch) == ([2], [MICRO], 16)
    assert kept.message == (
        "keeping the job's shape from the profile: 2 stages x 2 replicas, micro-batch 4, global "
        "batch 16; pass --stages (a list, or 'all') to search other shapes"
    )
    told = keep_shape(JOB, 4, global_batch=32, micro_batch_sizes=[2])
    assert (told.depths, told.micro_batch_sizes, told.global_batch) == ([2], [2], 32)
    assert "micro-batch 2 (--micro-batch-size), global batch 32 (--global-batch)" in told.message
    every = keep_shape(JOB, 4, search_all=True)
    assert (every.depths, every.micro_batch_sizes, every.global_batch) == (None, None, 16)
    assert (
        every.message == "the profiled job ran 2 stages x 2 replicas, micro-batch 4, global batch 16; searching "
        "--stages all"
    )
    assert keep_shape(JOB, 4, depths=[4]).depths == [4]
    other = keep_shape(JOB, 8)  # another cluster: the stage count is searched, the global batch kept
    assert (other.depths, other.global_batch) == (None, 16) and "the cluster has 8 devices" in other.message
    assert keep_shape(None, 4, global_batch=8) == keep_shape(None, 4, global_batch=8, depths=None)
    assert keep_shape(None, 4, global_batch=8).message is None
    with pytest.raises(PlannerError, match="--global-batch is required: the profile records no job shape"):
        keep_shape(None, 4)
    with pytest.raises(
        PlannerError,
        match=r"--global-batch 12: the job's shape from the profile \(2 stages x 2 "
        r"replicas, micro-batch 4\) needs a multiple of 8",
    ):
        keep_shape(JOB, 4, global_batch=12)


def test_job_shape_fields_are_checked():
    assert (JOB.world_size, JOB.micro_batches) == (4, 2)
    with pytest.raises(ValueError, match="global_batch 10 is not a multiple of data_parallel 2 x micro_batch_size 4"):
        JobShape(stages=2, data_parallel=2, micro_batch_size=4, global_batch=10)
    with pytest.raises(ValueError, match="stages"):
        JobShape(stages=0, data_parallel=2, micro_batch_size=4, global_batch=16)


def _plan(depth):
    return make_plan(profile(), parse_cluster("1x4,16GB,10Gbit"), 16, depths=[depth], baselines=False)


def test_a_plan_of_another_shape_names_every_change():
    assert changes_from_job(JOB, _plan(2).model_copy(update={"micro_batch_size": 4, "micro_batches": 2})) == []
    plan = _plan(4)
    changes = changes_from_job(JOB, plan)
    assert changes[0].startswith(
        "pipeline stages 2 -> 4: num_stages=4 where the PipelineModule is built, or the "
        "topology= the model class builds from its own pipeline-size argument (e.g. "
        "Megatron-DeepSpeed's --pipeline-model-parallel-size 4"
    ), changes
    assert changes[1] == "data-parallel replicas 2 -> 1: follows from the same 4 ranks over 4 stages"
    assert changes[2].startswith(
        f"batch keys train_micro_batch_size_per_gpu 4 -> {plan.micro_batch_size}, "
        f"gradient_accumulation_steps 2 -> {plan.micro_batches}, train_batch_size 16 "
        "(hippie.plan merges the plan's"
    ), changes
    ranks = shape_changes(plan, stages=2, world_size=8, stages_from="num_stages=")
    assert ranks[0] == "pipeline stages 2 -> 4: num_stages=4 where the PipelineModule is built"
    assert ranks[1].startswith("ranks 8 -> 4: the launcher's rank count")


def test_cli_keeps_the_profiled_shape_and_prints_the_changes_of_another(capsys, tmp_path):
    path = tmp_path / "profile.yaml"
    save_profile(profile(), path)
    assert load_profile(path).job == JOB  # the field round-trips
    argv = ["plan", "--profile", path, "--cluster", "1x4,16GB,10Gbit", "--no-baselines"]
    code, out, err = run(capsys, *argv, "--out", tmp_path / "plan.json")
    assert code == 0, err
    assert out.startswith(
        "keeping the job's shape from the profile: 2 stages x 2 replicas, micro-batch 4, global batch 16; pass --stages"
    )
    assert "the plan's shape" not in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (plan["pipeline_depth"], plan["data_parallel"], plan["micro_batch_size"], plan["global_batch"]) == (
        2,
        2,
        4,
        16,
    )
    code, out, err = run(capsys, *argv, "--stages", "4")
    assert code == 0, err
    assert (
        "the plan's shape is not the profiled job's (2 stages x 2 replicas, micro-batch 4, global batch 16); "
        "to run it, change:\n  - pipeline stages 2 -> 4: " in out
    )
    assert "--pipeline-model-parallel-size 4" in out and "gradient_accumulation_steps 2 -> " in out
    code, out, err = run(capsys, *argv, "--stages", "all", "--json")
    assert code == 0 and json.loads(out)["global_batch"] == 16  # the messages went to stderr
    assert "searching --stages all" in err
    # a profile without a job shape (older, or from hippie-ds profile): --global-batch is required
    save_profile(profile(job=None), path)
    code, out, err = run(capsys, *argv)
    assert code == 2 and "--global-batch is required" in err
    code, out, err = run(capsys, *argv, "--global-batch", 16)
    assert code == 0 and "keeping" not in out and "the plan's shape" not in out


def test_the_refusal_of_a_topology_built_model_names_topology_and_the_changes(tmp_path):
    """The user's case: the model class builds topology= for 2 stages x 2 replicas; the plan
    (made without --stages before profiles kept the shape) has 4 stages x 1."""
    plan = _plan(4)
    save_plan(plan, tmp_path / "plan.json")
    hippie_ds.set_config({"train_micro_batch_size_per_gpu": MICRO, "hippie": {"plan": str(tmp_path / "plan.json")}})
    with pytest.raises(PlanMismatchError) as info:
        GPTModelPipe(pipeline_model_parallel_size=2, data_parallel_size=2)
    text = str(info.value)
    assert text.startswith(
        "this job has 2 pipeline stages (from topology= (a PipeModelDataParallelTopology with "
        "pipe=2, data=2, model=1, passed by the model class GPTModelPipe)), but the plan for "
        "'gpt-shaped' has 4 stages x 1 data-parallel replicas on 4 ranks"
    ), text
    assert (
        "To run this plan, change:\n  - pipeline stages 2 -> 4: the topology= the model class builds from its own "
        "pipeline-size argument (e.g. Megatron-DeepSpeed's --pipeline-model-parallel-size 4" in text
    ), text
    assert "num_stages=4 where" not in text and "leave num_stages out" not in text
    assert (
        f"batch keys train_micro_batch_size_per_gpu {plan.micro_batch_size}, gradient_accumulation_steps "
        f"{plan.micro_batches}, train_batch_size 16" in text
    )
    assert text.endswith(
        "Or plan for this job's shape: hippie-ds plan --profile ... --stages 2 (a profile measured "
        "in place keeps the job's shape)"
    )


def test_the_refusal_names_num_stages_when_the_module_was_given_it(tmp_path):
    plan = _plan(4)
    save_plan(plan, tmp_path / "plan.json")
    with pytest.raises(PlanMismatchError) as info:
        hippie_ds.PipelineModule(layers=specs(), num_stages=2, config={"hippie": {"plan": str(tmp_path / "plan.json")}})
    assert "this job has 2 pipeline stages (from num_stages=2), but" in str(info.value)
    assert "- pipeline stages 2 -> 4: num_stages=4 where the PipelineModule is built\n" in str(info.value)
    with pytest.raises(PlanMismatchError) as info:  # a script's own topology=, no model class of its own
        hippie_ds.PipelineModule(
            layers=specs(),
            topology=PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2),
            config={"hippie": {"plan": str(tmp_path / "plan.json")}},
        )
    assert "(from topology= (a PipeModelDataParallelTopology with pipe=2, data=2, model=1))" in str(info.value)


def test_initialize_names_a_stock_modules_topology(tmp_path):
    """hippie_ds.initialize's check of a DeepSpeed PipelineModule (no plan of its own): the stage
    count from its topology."""
    from hippie_ds.adapter.startup.inputs import apply_plan as _apply_plan
    from hippie_ds.config import split_config

    save_plan(_plan(4), tmp_path / "plan.json")
    config = {"train_micro_batch_size_per_gpu": MICRO, "hippie": {"plan": "plan.json"}}

    def refusal(topo):
        model = SimpleNamespace(_layer_specs=specs(), world_size=4, num_stages=2, _topo=topo)
        with pytest.raises(PlanMismatchError) as info:
            _apply_plan(model, config, split_config(config)[2], str(tmp_path / "ds.json"))
        return str(info.value)

    text = refusal(PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2))
    assert (
        "from topology= (a PipeModelDataParallelTopology with pipe=2, data=2, model=1, passed by the model "
        "class SimpleNamespace)"
        in text
        and "- pipeline stages 2 -> 4: the topology= the model class" in text
    )
    text = refusal(PipeDataParallelTopology(num_pp=2, num_dp=2))  # what DeepSpeed builds from num_stages=
    assert "from num_stages=2 (or a PipeDataParallelTopology passed as topology=)" in text
