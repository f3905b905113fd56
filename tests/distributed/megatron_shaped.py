"""A rank worker in the shape of Megatron-DeepSpeed's GPT pipeline (``GPTModelPipe``), the client
hippie-ds is accepted against, with each of its traits that broke a schedule once:

- layer 0 is a parameterless function (Megatron's ``_to_float16``);
- the embedding is a ``TiedLayerSpec`` whose last-stage copy (the output projection) uses only
  the word embedding: its ``position_embeddings`` take no part in that stage's output;
- the client builds its own optimizer with two parameter groups (weight decay on / off) and its
  own LR scheduler whose ``step(increment)`` needs an argument (``OptimizerParamScheduler``),
  warm-up then cosine, as Megatron does;
- gradient clipping 1.0; the training loop never calls ``drain()``;
- partition by layer type (``partition_method="type:Block"``).

Each engine name in ``--engines`` (``[PRECISION:]NAME``) is trained in turn in this one launch
(``stock`` is ``deepspeed.initialize``; ``SCHEDULE+all`` sets ``hippie.deferred_layers: "all"``, ``SCHEDULE+N`` the
count N; ``SCHEDULE+drain``
calls ``drain()`` after the last step; ``+tuple`` trains :func:`tuple_specs`, tuples between the
stages, in a ``hippie_ds.PipelineModule`` with the schedule's model chunks; ``+profile`` sets
``hippie.profile``, writing ``OUT/[PRECISION:]NAME/profile.yaml``). Per rank and engine it writes losses, this rank's
layers and its copy of the tied word embedding to ``OUT/[PRECISION:]NAME/rankR.pt``, and both as they were
before the first step and after it (``start``, ``first``).

The drop-in (``+argv``, ``+b64``): the model is :class:`GPTModelPipe`, a subclass of
``hippie_ds.PipelineModule`` built without ``config=``, as Megatron-DeepSpeed builds its own; the
config is a file named by ``--deepspeed_config PATH`` in ``sys.argv`` (``+b64``: the base64 JSON in its
place) while the model is built, and ``hippie_ds.initialize`` gets it as a dict (Megatron reads the
file and passes ``config=``). Its weights are re-drawn per global layer index (:func:`reseed`), the
same whatever the layout. ``+linearstack`` / ``+alexnet``: DeepSpeed's own unit-test models
(ds_unit_models.py) in place of the GPT, built the same way. ``+plan`` (with ``+argv``): the config names no
schedule, only ``"hippie": {"plan": ...}``, a :func:`chunked_plan` for the engine's schedule (model chunks,
boundaries, re-computed layers), which the module takes from the config in ``sys.argv`` and
``hippie_ds.initialize`` merges in; the module keeps DeepSpeed's default topology, as Megatron's does (a plan
for one node sets no placement).
Before the engines, each rank builds
the GPT both with DeepSpeed's class and with ``GPTModelPipe`` and no config anywhere, and writes
whether their partition and weights agree to ``OUT/no-config/rankR.pt``.
"""

import argparse
import base64
import json
import os
import sys

import deepspeed
import ds_unit_models
import torch
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

import hippie_ds
from hippie_ds.adapter.module.chunks import held_chunks
from tools.examples.lr_schedule import ParamScheduler

VOCAB, HIDDEN, SEQ, MICRO = 32, 16, 8, 2
# bf16-zero1: BF16_Optimizer (fp32 accumulation); bf16-plain-zero1: as users write it, DeepSpeedZeroOptimizer
PRECISIONS = ("fp32", "bf16", "bf16-zero1", "bf16-plain-zero1", "fp32-zero1")


def _to_float(x):
    """Megatron's first layer: a function, no parameters."""
    return x


class Embedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = torch.nn.Embedding(SEQ, HIDDEN)

    def forward(self, ids):
        return self.word_embeddings(ids) + self.position_embeddings(torch.arange(ids.shape[1]))


def _logits(embedding, x):
    """The tied output projection: only the word embedding is used on the last stage."""
    return x @ embedding.word_embeddings.weight.t()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


def specs(blocks):
    tied = dict(tied_weight_attr="word_embeddings.weight")
    return (
        [_to_float, TiedLayerSpec("embed", Embedding, **tied)]
        + [LayerSpec(Block) for _ in range(blocks)]
        + [LayerSpec(torch.nn.LayerNorm, HIDDEN), TiedLayerSpec("embed", Embedding, forward_fn=_logits, **tied)]
    )


class TupleBlock(Block):
    """A block between stages that pass tuples, as Megatron passes (hidden, attention mask): an
    integer side input (positions) that needs no gradient travels with the hidden state. Dropout:
    the random stream must go on as without profiling."""

    def __init__(self):
        super().__init__()
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, inputs):
        x, positions = inputs
        return self.dropout(super().forward(x)) * (1 + positions.unsqueeze(-1) / SEQ), positions


def _with_positions(x):
    """Function layer: the hidden state and its integer positions, a tuple from here on."""
    return x, torch.arange(x.shape[1]).expand(x.shape[0], -1).contiguous()


def tuple_specs(blocks):
    """``specs`` passing tuples between the blocks (``+tuple`` engines; ``+profile`` profiles it in
    place): a function, a tied module, its forward_fn copy, a lambda, tuple activations with an
    integer tensor."""
    tied = dict(tied_weight_attr="word_embeddings.weight")
    return (
        [_to_float, TiedLayerSpec("embed", Embedding, **tied), _with_positions]
        + [LayerSpec(TupleBlock) for _ in range(blocks)]
        + [
            lambda inputs: inputs[0],
            LayerSpec(torch.nn.LayerNorm, HIDDEN),
            TiedLayerSpec("embed", Embedding, forward_fn=_logits, **tied),
        ]
    )


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


class GPTModelPipe(hippie_ds.PipelineModule):
    """Megatron-DeepSpeed's ``GPTModelPipe`` in shape: a subclass of the pipeline module (here
    hippie-ds's, the one-line change) that builds it with DeepSpeed's arguments and no config."""

    def __init__(self, blocks, num_stages, topology=None):
        super().__init__(
            layers=specs(blocks),
            num_stages=None if topology else num_stages,
            topology=topology,
            loss_fn=loss_fn,
            partition_method="type:Block",
        )


# ``+plan``: a planner plan for interleaved-1f1b with these model-part boundaries (not DeepSpeed's
# 'type:Block' cut of 2 or 4 parts) and re-computed layers (a run of two in one chunk, one in another)
PLAN_BOUNDARIES, PLAN_CHECKPOINTED = [0, 2, 3, 5, 8], [3, 4, 6]


def chunked_plan(
    stages=2,
    micro_batches=4,
    dp=2,
    schedule="interleaved-1f1b",
    boundaries=PLAN_BOUNDARIES,
    checkpointed=PLAN_CHECKPOINTED,
    blocks=4,
):
    """A plan of :func:`specs` (``blocks`` blocks) for ``schedule``: ``hippie_ds.planner.make_plan`` on a
    synthetic profile with this model's layer names and parameter sizes (so its fingerprint fits),
    then set to ``boundaries`` and ``checkpointed`` through the ``Plan`` model (which checks them)."""
    from hippie_ds.adapter.module.pipeline_module import layer_names, layer_param_bytes
    from hippie_ds.planner import LayerProfile, Plan, Profile, make_plan, parse_cluster

    layers = specs(blocks)
    profile = Profile(
        model="megatron-shaped",
        batch_size=MICRO,
        layers=[
            LayerProfile(name=n, forward=1e-3, backward=2e-3, output_bytes=4.0 * MICRO * SEQ * HIDDEN, param_bytes=b)
            for n, b in zip(layer_names(layers), layer_param_bytes(layers))
        ],
    )
    plan = make_plan(
        profile,
        parse_cluster(f"1x{stages * dp},1GB,10Gbit"),
        MICRO * micro_batches * dp,
        schedules=[schedule],
        depths=[stages],
        micro_batch_sizes=[MICRO],
        baselines=False,
    )
    data = plan.model_dump(mode="json")
    data.update(boundaries=list(boundaries), checkpointed_layers=list(checkpointed))
    for p, st in enumerate(data["stages"]):
        st.update(
            first_layer=boundaries[p],
            end_layer=boundaries[p + 1],
            checkpointed=[i for i in checkpointed if boundaries[p] <= i < boundaries[p + 1]],
        )
    return Plan.model_validate(data)


def layers_of(module):
    """(global layer index, layer) of every layer this rank holds, every model chunk."""
    if hasattr(module, "local_layers"):
        return module.local_layers()
    return [(module._local_start + i, f) for i, f in enumerate(module.forward_funcs)]


def reseed(module):
    """Weights that do not depend on the layout: every layer's parameters re-drawn by its own
    initialiser from a seed of its global index, each tied module from a seed of its key (DeepSpeed
    draws the layers a rank builds from one random stream in build order, so a layout that builds
    other layers on a rank starts from other weights)."""
    tied = {id(m) for m in module.tied_modules.values()}
    for idx, layer in layers_of(module):
        if isinstance(layer, torch.nn.Module) and id(layer) not in tied:
            torch.manual_seed(10_000 + idx)
            for m in layer.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    for key in sorted(module.tied_modules):
        torch.manual_seed(sum(map(ord, key)))
        for m in module.tied_modules[key].modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def build_from_argv(cfg, out, opts, model, blocks, stages, topology=None):
    """The model built while ``sys.argv`` names the config (a file, or base64 with ``+b64``)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"ds_config.rank{torch.distributed.get_rank()}.json")  # each rank its own: no race
    with open(path, "w") as f:
        json.dump(cfg, f)
    value = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode() if "b64" in opts else path
    saved = list(sys.argv)
    sys.argv = saved + ["--deepspeed_config", value]
    try:
        module = GPTModelPipe(blocks, stages, topology) if model == "megatron" else ds_unit_models.build(model, stages)
    finally:
        sys.argv = saved
    reseed(module)
    return module


def check_no_config(out, blocks, stages):
    """Nothing names a config: GPTModelPipe is DeepSpeed's class (same partition, same weights)."""
    built = []
    for cls in (
        lambda: PipelineModule(layers=specs(blocks), num_stages=stages, loss_fn=loss_fn, partition_method="type:Block"),
        lambda: GPTModelPipe(blocks, stages),
    ):
        torch.manual_seed(1234)
        built.append(cls())
    stock, ours = built
    same = (
        list(stock.parts) == list(ours.parts)
        and stock.state_dict().keys() == ours.state_dict().keys()
        and all(torch.equal(v, ours.state_dict()[k]) for k, v in stock.state_dict().items())
    )
    os.makedirs(os.path.join(out, "no-config"), exist_ok=True)
    torch.save(
        {
            "same": same,
            "parts": [int(x) for x in ours.parts],
            "chunks": ours.virtual_stages,
            "source": ours.hippie_config_source,
        },
        os.path.join(out, "no-config", f"rank{torch.distributed.get_rank()}.pt"),
    )


def config(precision, schedule, opts, micro_batches, dp, profile_out=None):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "train_batch_size": MICRO * micro_batches * dp,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
    }
    if precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if precision.endswith("zero1"):
        cfg["zero_optimization"] = {"stage": 1}
    if precision == "bf16-zero1":  # DeepSpeed's BF16_Optimizer with ZeRO-1 (else DeepSpeedZeroOptimizer)
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if schedule != "stock":
        cfg["pipeline"] = {"schedule": schedule}
        for opt in opts:
            if opt == "all" or opt.isdigit():
                cfg["hippie"] = {"deferred_layers": int(opt) if opt.isdigit() else opt}
        if "profile" in opts:
            cfg.setdefault("hippie", {})["profile"] = {"out": profile_out, "steps": 2, "repeats": 1}
    return cfg


def micro_batches_of(step, replica, micro_batches):
    for m in range(micro_batches):
        g = torch.Generator().manual_seed(7919 * step + 104_729 * replica + m)
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


def data(replica, micro_batches):
    step = 0
    while True:
        yield from micro_batches_of(step, replica, micro_batches)
        step += 1


def snapshot(engine):
    """(this rank's layers' states {layer index: state}, its tied word embeddings {key: weight})."""
    held = (
        engine.module.local_layers()
        if hasattr(engine.module, "local_layers")
        else [(int(engine.module._local_start) + i, f) for i, f in enumerate(engine.module.forward_funcs)]
    )
    layers = {
        int(i): {k: v.detach().float().clone() for k, v in f.state_dict().items()}
        for i, f in held
        if isinstance(f, torch.nn.Module)
    }
    tied = {k: m.word_embeddings.weight.detach().float().clone() for k, m in engine.module.tied_modules.items()}
    return layers, tied


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="of engines named without PRECISION:")
    p.add_argument("--engines", default="stock,1f1b")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    check_no_config(args.out, args.blocks, args.stages)
    kept = []
    for name in args.engines.split(","):
        precision, _, engine = name.rpartition(":")
        precision = precision or args.precision
        assert precision in PRECISIONS, f"{name}: precision {precision!r}, allowed {PRECISIONS}"
        schedule, *opts = engine.split("+")
        torch.manual_seed(1234)  # every engine starts from the same weights
        profile_out = os.path.join(args.out, name, "profile.yaml")
        cfg = config(precision, schedule, opts, args.micro_batches, world // args.stages, profile_out)
        model = next((o for o in opts if o in ds_unit_models.MODELS), "megatron")
        topology = None
        if "plan" in opts:  # the config names only the plan (relative to it), not the schedule: the plan's
            from hippie_ds.planner import save_plan

            plan = chunked_plan(args.stages, args.micro_batches, world // args.stages, schedule, blocks=args.blocks)
            save_plan(plan, os.path.join(args.out, name, f"plan.rank{rank}.json"))
            del cfg["pipeline"]
            cfg["hippie"] = {"plan": f"plan.rank{rank}.json"}
        if model != "megatron" or "argv" in opts or "b64" in opts:  # the drop-in: sys.argv names the config
            module = build_from_argv(cfg, os.path.join(args.out, name), opts, model, args.blocks, args.stages, topology)
        elif "tuple" in opts:  # hippie_ds.PipelineModule: the schedule's model chunks (virtual stages)
            module = hippie_ds.PipelineModule(
                layers=tuple_specs(args.blocks),
                num_stages=args.stages,
                loss_fn=loss_fn,
                partition_method="type:Block",
                config=cfg,
            )
        else:
            module = PipelineModule(
                layers=specs(args.blocks), num_stages=args.stages, loss_fn=loss_fn, partition_method="type:Block"
            )
        decay = [p for n, p in module.named_parameters() if p.dim() > 1 and "norm" not in n]
        no_decay = [p for n, p in module.named_parameters() if not (p.dim() > 1 and "norm" not in n)]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
        )
        # step(increment) counts samples (DeepSpeed's pipeline engine passes the batch size), as
        # Megatron's scheduler does: the rate stays above 0 for every step
        batch = cfg["train_batch_size"]
        scheduler = ParamScheduler(optimizer, 1e-2, warmup=2 * batch, total=2 * args.steps * batch)
        if model == "megatron" and ("argv" in opts or "b64" in opts) and "hippie" not in schedule:
            # the GPT's layout comparisons (1f1b vs interleaved-1f1b, zb-v, a plan): the layouts' first
            # update differs by ulps (cause open: not clipping, measured without it) and AdamW at 1e-2
            # amplifies that to ~5e-4 after three more; one update (the rate is 0 after it) keeps them
            # within 1e-5. DeepSpeed's own models and every other engine keep the rate above 0.
            scheduler = ParamScheduler(optimizer, 1e-2, warmup=2, total=args.steps)
        init = deepspeed.initialize if schedule == "stock" else hippie_ds.initialize
        engine, *_ = init(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
        it = (
            data(engine.grid.data_parallel_id, args.micro_batches)
            if model == "megatron"
            else ds_unit_models.data(model, engine.grid.data_parallel_id, args.micro_batches)
        )
        start = snapshot(engine)
        losses = [float(engine.train_batch(it))]
        first = snapshot(engine)
        losses += [float(engine.train_batch(it)) for _ in range(args.steps - 1)]
        if "drain" in opts:
            engine.drain()
        layers, tied = snapshot(engine)
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        torch.save(
            {
                "stage": int(engine.stage_id),
                "replica": int(engine.grid.data_parallel_id),
                "losses": losses,
                "layers": layers,
                "tied": tied,
                "start": start,
                "first": first,
                "lr": scheduler.get_lr(),
                "parts": [int(x) for x in engine.module.parts],
                "chunks": held_chunks(engine.module),
                "checkpointed": list(getattr(engine.module, "checkpointed_layers", [])),
                "global_steps": engine.global_steps,
            },
            os.path.join(args.out, name, f"rank{rank}.pt"),
        )
        torch.distributed.barrier()
        kept.append(engine)  # alive until exit: what is in flight is warned about then


if __name__ == "__main__":
    main()
    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
