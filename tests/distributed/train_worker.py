"""Rank worker for the distributed tests: trains the tiny model with each requested engine
(stock DeepSpeed or a hippie-ds schedule) in turn and saves parameters and losses."""

import argparse
import json
import os
import signal

import torch
import deepspeed
from deepspeed.runtime.pipe.module import PipelineModule

import model as tiny

import hippie_ds

emulated = None  # tools/bench/emulated.py, imported with --emulated


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor alive in this process, after a collection (a gc scan: 0.5 s per engine and rank)."""
    import gc

    gc.collect()
    return [o for o in gc.get_objects() if torch.is_tensor(o)]


def largest_live_tensor() -> int:
    """Elements of the largest tensor alive in this process (between calls: no activations)."""
    return max((t.numel() for t in _live_tensors()), default=0)


def live_tensor_bytes() -> int:
    """An independent count of what this process holds: every live tensor's storage once, in bytes."""
    seen, total = set(), 0
    for t in _live_tensors():
        if t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def split_name(name):
    """Engine name -> (schedule, options): "pipedream+vs" runs pipedream with vertical_sync,
    "2bw+ckpt3" saves a checkpoint after 3 steps and resumes from it in a fresh engine,
    "zb-h1+bf16" in bf16 and "zb-h1+bf16+zero1" in bf16 + ZeRO-1 whatever --bf16 / --zero say
    (several precisions in one launch), "interleaved-1f1b+recompute" re-computing every layer
    (hippie_ds.PipelineModule's checkpointed_layers), "zb-h1+seqfirst" on the sequence-first model
    (model.seqfirst_layer_specs: stage boundaries after ``x.transpose(0, 1).contiguous()``),
    "hippie-zb+sync" with no deferred stage (the synchronous rule, whatever --deferred says),
    "hippie+nostale" without a staleness correction, "2bw+adam" with hippie.staleness "adam" ("2bw+made":
    "extrapolate-made"), "hippie+dl1" with hippie.deferred_layers 1 (whatever --deferred-layers says),
    "zb-h1+bf16+immediate" with DeepSpeed's immediate_grad_update, "zb-h1+fp16" in fp16 with DeepSpeed's dynamic loss
    scale (+zero1: on DeepSpeedZeroOptimizer; +fused: with "optimizer": {"type": "Adam"}, FP16_Optimizer), "zb-h1+attrs"
    with Megatron's attributes on every parameter (model.megatron_attributes: an int ``stride`` hides
    ``Tensor.stride()``), "hippie+fp16+ovf1.2" with stage 1's first gradient infinite in step 2
    (:func:`inject_overflows`), "hippie+fp16+p12" with an initial loss scale of 2**12 (default 2**20)."""
    schedule, *opts = name.split("+")
    return schedule, opts


def config(args, schedule, dp, opts=()):
    cfg = {
        "train_micro_batch_size_per_gpu": tiny.MICRO_BATCH_SIZE,
        "train_batch_size": tiny.MICRO_BATCH_SIZE * args.micro_batches * dp,
        "optimizer": {
            "type": args.optimizer,
            "params": {"lr": args.lr, **({"torch_adam": True} if args.optimizer == "AdamW" else {})},
        },
        "steps_per_print": 10_000,
        "pipeline": {},
    }
    if args.clip or args.emulated:  # DeepSpeed clips at norm 1.0 by default; the emulated models' norm is above it
        cfg["gradient_clipping"] = args.clip
    if args.comm_dtype:
        cfg["communication_data_type"] = args.comm_dtype
    bf16, zero = args.bf16 or "bf16" in opts, args.zero or (1 if "zero1" in opts else 0)
    if "fused" in opts:  # DeepSpeed's own Adam (FusedAdam; FP16_Optimizer in fp16), decoupled decay as torch's AdamW
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": args.lr, "weight_decay": 0.01}}
    if "fp16" in opts:  # dynamic loss scale; 2**20 overflows at the first step (a skipped step, the scale halved)
        power = next((int(o[1:]) for o in opts if o[:1] == "p" and o[1:].isdigit()), 20)  # "+p12": 2**12
        cfg["fp16"] = {"enabled": True, "initial_scale_power": power, "loss_scale_window": 2, "hysteresis": 1}
    if bf16:
        # immediate: DeepSpeed's hooks move each bf16 gradient into the accumulator during backward
        immediate = args.bf16_immediate or "immediate" in opts
        cfg["bf16"] = {"enabled": True, **({"immediate_grad_update": True} if immediate else {})}
    if zero:
        # DeepSpeed's bf16 + ZeRO-1 pipeline path (BF16_Optimizer) needs fp32 gradient accumulation
        cfg["zero_optimization"] = {"stage": zero}
        if "plain" not in opts and not args.zero_plain and "fp16" not in opts:  # plain: as users write it, ZeRO's own
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        cfg["zero_allow_untested_optimizer"] = True  # SGD
    if schedule != "stock":
        cfg["pipeline"]["schedule"] = schedule
        cfg["hippie"] = {}
        if schedule.startswith("hippie") and args.deferred is not None:
            cfg["hippie"]["deferred_stages"] = [int(s) for s in args.deferred.split(",") if s]
        if schedule.startswith("hippie") and args.deferred_layers != "default":
            layers = args.deferred_layers
            cfg["hippie"]["deferred_layers"] = int(layers) if layers.isdigit() else layers
        if args.staleness is not None:
            method, _, coefficient = args.staleness.partition(":")
            cfg["hippie"]["staleness"] = {
                "method": method,
                **({"coefficient": float(coefficient)} if coefficient else {}),
            }
        for opt in opts:  # "dlN": hippie.deferred_layers N for this engine, whatever --deferred-layers says
            if opt.startswith("dl") and opt[2:].isdigit():
                cfg["hippie"]["deferred_layers"] = int(opt[2:])
        if "nostale" in opts:  # no staleness correction for this engine, whatever --staleness says
            cfg["hippie"]["staleness"] = {"method": "none"}
        if "adam" in opts:  # Adam's predicted update, with --staleness's coefficient when given
            cfg["hippie"]["staleness"] = {**cfg["hippie"].get("staleness", {}), "method": "adam"}
        if "made" in opts:  # extrapolation and the made weights, with --staleness's coefficient when given
            cfg["hippie"]["staleness"] = {**cfg["hippie"].get("staleness", {}), "method": "extrapolate-made"}
        for opt in opts:  # "efG": hippie.staleness.error_feedback G/10 (ef5: 0.5) on top of the method above
            if opt.startswith("ef") and opt[2:].isdigit():
                cfg["hippie"]["staleness"] = {**cfg["hippie"].get("staleness", {}), "error_feedback": int(opt[2:]) / 10}
        for opt in opts:  # "dcL": hippie.staleness.delay_compensation L (with "nostale": method "none")
            if opt.startswith("dc") and opt[2:].isdigit():
                cfg["hippie"]["staleness"] = {**cfg["hippie"].get("staleness", {}), "delay_compensation": int(opt[2:])}
        if "sync" in opts:
            cfg["hippie"]["deferred_stages"] = []
        if "vs" in opts:
            cfg["hippie"]["schedule_params"] = {"vertical_sync": True}
        if args.schedule_override:
            override = json.loads(args.schedule_override)
            cfg["pipeline"].update(override.pop("pipeline", {}))
            cfg.update(override.pop("deepspeed", {}))
            cfg["hippie"].update(override)
        if args.timeline:
            cfg["hippie"]["timeline_dir"] = os.path.join(args.out, schedule, "timeline")
    return cfg


def crash_in_first_backward(engine, at_step):
    """The engine's first backward (backward, backward_input or forward_backward ops) of step
    ``at_step`` raises inside its handler, mid-schedule, as a model the handler cannot serve would."""
    from hippie_ds.adapter.stage import handlers
    from hippie_ds.schedules.ir import OpKind

    for kind in (OpKind.BACKWARD, OpKind.BACKWARD_INPUT, OpKind.FORWARD_BACKWARD):

        def crashing(rt, *args, _handler=handlers.HANDLERS[kind], **kwargs):
            if engine.global_steps == at_step:
                raise RuntimeError(f"rank {engine.global_rank} crashes on purpose inside its handler at step {at_step}")
            return _handler(rt, *args, **kwargs)

        handlers.HANDLERS[kind] = crashing  # this rank's process only: it trains one engine


def inject_overflows(engine, opts):
    """``ovfS.T`` options: stage S's first parameter gets an infinite gradient in step T (every
    micro-batch, every replica), as an fp16 overflow would (reference_fp16.Fp16's overflow_at)."""
    for opt in opts:
        if opt.startswith("ovf"):
            stage, step = map(int, opt[3:].split("."))
            if engine.stage_id == stage:
                layers = (
                    engine.module.local_layers()
                    if hasattr(engine.module, "local_layers")
                    else enumerate(engine.module.forward_funcs)
                )  # the stage's first layer's, as reference_fp16 injects
                first = next(
                    p
                    for _, layer in layers
                    if isinstance(layer, torch.nn.Module)
                    for p in layer.parameters()
                    if p.requires_grad
                )
                first.register_hook(lambda g, step=step: g * float("inf") if engine.global_steps == step else g)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--engines", default="stock,1f1b")
    p.add_argument("--optimizer", default="SGD")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--comm-dtype", default=None, help="DeepSpeed's communication_data_type (every engine)")
    p.add_argument("--bf16-immediate", action="store_true", help='bf16 with "immediate_grad_update": true')
    p.add_argument("--tied", action="store_true", help="the model with its first layer tied to a head (last stage)")
    p.add_argument(
        "--emulated",
        default=None,
        help="a profiled model whose compute is a wait (tools/bench/"
        "emulated.py: vgg16, gnmt8, gnmt16), its waits 1000x shorter",
    )
    p.add_argument(
        "--megatron",
        action="store_true",
        help="the Megatron-shaped model (model.megatron_layer_specs): "
        "3-D activations, views as stage outputs, a tied embedding with a parameter unused on the last "
        "stage",
    )
    p.add_argument("--zero", type=int, default=0, help="zero_optimization.stage (with fp32 gradient accumulation)")
    p.add_argument(
        "--zero-plain",
        action="store_true",
        help="--zero without data_types (bf16: DeepSpeedZeroOptimizer "
        "accumulating in bf16; fp32 takes DeepSpeedZeroOptimizer either way)",
    )
    p.add_argument("--deferred", default=None)
    p.add_argument(
        "--deferred-layers",
        default="all",
        help='hippie.deferred_layers of hippie schedules: a count, '
        '"all" (the whole deferred stage, the references\' default) or "default" (the key left out)',
    )
    p.add_argument(
        "--staleness", default=None, help="hippie.staleness as METHOD[:COEFFICIENT] (default: the config's default)"
    )
    p.add_argument("--flush", action="store_true")
    p.add_argument("--drain", action="store_true", help="engine.drain() after the last step (batches in flight)")
    p.add_argument("--timeline", action="store_true")
    p.add_argument(
        "--memory-count",
        action="store_true",
        help="after the last train_batch: the bench's state "
        "count (tools.bench.engines.state_bytes) and an independent count of live tensor storages",
    )
    p.add_argument(
        "--largest-tensor",
        action="store_true",
        help="record the largest tensor alive after training (a gc scan: 0.5 s per engine and rank)",
    )
    p.add_argument("--checkpoint-at", type=int, default=None, help="save after this many steps, then exit")
    p.add_argument("--resume", default=None, help="checkpoint dir to resume from")
    p.add_argument(
        "--resave",
        default=None,
        help="with --resume: save what was loaded to this dir, in today's format, before training on",
    )
    p.add_argument(
        "--resume-weights-only",
        action="store_true",
        help="--resume loads DeepSpeed's per-layer weight "
        "files only (a checkpoint of another layout: optimizer state is per stage)",
    )
    p.add_argument("--eval", action="store_true", help="eval_batch on the next batch after training; its loss saved")
    p.add_argument("--crash-rank", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument(
        "--crash-in-handler",
        action="store_true",
        help="--crash-rank raises inside the handler of its "
        "first backward of step 1, and every rank's script catches what train_batch raises and calls a "
        "barrier before re-raising",
    )
    p.add_argument(
        "--refusal-barrier",
        action="store_true",
        help="a rank whose engine build raises prints the "
        "error, then waits in a barrier for the others to do the same before it exits (the launcher ends "
        "the other ranks at the first failure: a slower rank's refusal would go unprinted)",
    )
    p.add_argument(
        "--schedule-override",
        default=None,
        help="JSON merged into the hippie section; its "
        "'pipeline' and 'deepspeed' keys into the pipeline section and the top level (bad-input tests)",
    )
    return p.parse_args()


def main():
    args = parse_args()
    if args.emulated:
        global emulated
        from tools.bench import emulated
    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    dp = world // args.stages

    def build(name):
        schedule, opts = split_name(name)
        specs = (
            emulated.emulated_specs(args.emulated, tiny.MICRO_BATCH_SIZE, speedup=1000.0)
            if args.emulated
            else tiny.seqfirst_layer_specs()
            if "seqfirst" in opts
            else tiny.megatron_layer_specs()
            if args.megatron
            else tiny.tied_layer_specs()
            if args.tied or "tied" in opts
            else tiny.layer_specs()
        )
        cfg = config(args, schedule, dp, opts)
        # hippie_ds.PipelineModule builds the model chunks the config's schedule runs (virtual stages)
        kind, extra = (PipelineModule, {}) if schedule == "stock" else (hippie_ds.PipelineModule, {"config": cfg})
        if "recompute" in opts:  # re-compute every layer in backward (per-layer re-computation, the planner's)
            extra["checkpointed_layers"] = list(range(len(specs)))
        module = kind(
            layers=specs,
            num_stages=args.stages,
            loss_fn=emulated.loss_fn if args.emulated else tiny.loss_fn,
            topology=hippie_ds.make_topology(args.stages, world),
            partition_method="uniform",
            seed_layers=True,
            base_seed=tiny.BASE_SEED,
            seed_fn=tiny.seed_cpu,
            **extra,
        )
        if "attrs" in opts:
            tiny.megatron_attributes(module)
        init = deepspeed.initialize if schedule == "stock" else hippie_ds.initialize
        engine, *_ = init(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=cfg
        )
        return engine

    def data(replica, start, opts):
        if args.emulated:
            it = emulated.data_iter(args.emulated, tiny.MICRO_BATCH_SIZE, args.micro_batches, replica)
            for _ in range(start * args.micro_batches):
                next(it)
        else:
            sequences = args.megatron or "seqfirst" in opts
            it = (tiny.megatron_data_iter if sequences else tiny.data_iter)(
                replica, args.micro_batches, start_step=start
            )
        if "fp16" in opts:
            return ((x.half(), y.half()) for x, y in it)
        return ((x.bfloat16(), y.bfloat16()) for x, y in it) if args.bf16 or "bf16" in opts else it

    for name in args.engines.split(","):
        _, opts = split_name(name)
        ckpt_at = next((int(o[4:]) for o in opts if o.startswith("ckpt")), None)
        try:
            engine = build(name)
        except Exception as e:
            if args.refusal_barrier:  # every rank's refusal printed before any rank exits
                print(f"rank {rank} refused: {e}", flush=True)
                torch.distributed.barrier()
            raise
        inject_overflows(engine, opts)
        replica = engine.grid.data_parallel_id
        hook_counts = {}  # the public instruction hook, beside the timeline it also feeds
        if args.timeline and hasattr(engine, "add_instruction_hook"):
            engine.add_instruction_hook(lambda e: hook_counts.__setitem__(e.kind, hook_counts.get(e.kind, 0) + 1))
        start = 0
        if args.resume:
            weights_only = {"load_optimizer_states": False, "load_lr_scheduler_states": False}
            _, client = engine.load_checkpoint(args.resume, **(weights_only if args.resume_weights_only else {}))
            start = client["next_step"]
            if args.resave:
                engine.save_checkpoint(args.resave, client_state={"next_step": start})
        it = data(replica, start, opts)
        losses, applied, norms = [], [], []
        step = start
        if args.crash_in_handler and args.crash_rank == rank:
            crash_in_first_backward(engine, at_step=1)
        while step < args.steps:
            if args.crash_rank == rank and step == 1 and not args.crash_in_handler:
                raise RuntimeError(f"rank {rank} crashes on purpose at step {step}")
            if args.kill_rank == rank and step == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                losses.append(float(engine.train_batch(it)))
                applied.append(bool(engine.was_step_applied()))  # what a client reads (Megatron: skipped iterations)
                norm = engine.get_global_grad_norm()  # Megatron logs it as "grad norm"
                norms.append(None if norm is None else float(norm))
            except BaseException:
                if args.crash_in_handler:  # a script's clean-up collective (a barrier, a checkpoint)
                    torch.distributed.barrier()
                raise
            step += 1
            if args.checkpoint_at is not None and step == args.checkpoint_at:
                engine.save_checkpoint(os.path.join(args.out, name, "ckpt"), client_state={"next_step": step})
                break
            if ckpt_at == step:  # save, then go on in a fresh engine resumed from the checkpoint
                ckpt = os.path.join(args.out, name, "ckpt")
                engine.save_checkpoint(ckpt, client_state={"next_step": step})
                engine = build(name)
                inject_overflows(engine, opts)
                _, client = engine.load_checkpoint(ckpt)
                assert client["next_step"] == step
                it = data(replica, step, opts)
        if (args.flush or "flush" in opts) and hasattr(engine, "drain"):
            engine.drain()

        def module_state():
            layers = (
                engine.module.local_layers()
                if hasattr(engine.module, "local_layers")
                else [(engine.module._local_start + i, f) for i, f in enumerate(engine.module.forward_funcs)]
            )
            return {
                i: {k: v.detach().float().clone() for k, v in layer.state_dict().items()}
                for i, layer in layers
                if isinstance(layer, torch.nn.Module)
            }

        memory = None
        if args.memory_count:  # before anything below allocates: the state as the step left it
            from tools.bench.engines import state_bytes

            memory = {
                "bench": state_bytes(engine),
                "bench_alive": state_bytes(engine, released_grads=False),
                "live": live_tensor_bytes(),
            }
        # what a user reads from the module after the last train_batch, batches still in flight
        in_flight = getattr(engine, "has_in_flight", lambda: False)()
        between_calls = {"layers": module_state(), "weight_versions": engine.weight_versions()} if in_flight else None
        # --drain completes the batches of continuous schedules (2bw, pipedream); a deferred
        # stage's pending gradient stays pending unless --flush
        evaluated = float(engine.eval_batch(data(replica, step, opts))) if args.eval else None
        drained = bool(engine.drain()) if args.drain and getattr(engine, "has_in_flight", lambda: False)() else None
        state = module_state()
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        torch.save(
            {
                "stage": engine.stage_id,
                "replica": replica,
                "losses": losses,
                "applied": applied,
                "layers": state,
                "grad_norms": norms,
                "parts": list(engine.module.parts),
                "params": engine.compiled_schedule.params if hasattr(engine, "compiled_schedule") else {},
                "drained": drained,
                "eval": evaluated,
                "weight_versions": engine.weight_versions() if hasattr(engine, "weight_versions") else None,
                "between_calls": between_calls,
                "hook_counts": hook_counts,
                "optimizer": type(engine.optimizer).__name__,
                "skipped_steps": engine.skipped_steps,
                # what the module really computes in (an fp16 engine that fell back to fp32 shows it)
                "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
                "loss_scale": float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None,
                "tied": {
                    k: {n: v.detach().float().clone() for n, v in m.state_dict().items()}
                    for k, m in engine.module.tied_modules.items()
                },
                # BF16_Optimizer: how many ranks share the fp32 master weights (ZeRO-1 over data parallelism)
                "partitions": getattr(engine.optimizer, "partition_count", None),
                "largest_tensor": largest_live_tensor() if args.largest_tensor else None,
                "memory": memory,
            },
            os.path.join(args.out, name, f"rank{rank}.pt"),
        )
        if hasattr(engine, "write_timeline"):
            engine.write_timeline()
        torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(args.out, "done.json"), "w") as f:
            json.dump({"engines": args.engines.split(",")}, f)


if __name__ == "__main__":
    main()
    hippie_ds.shutdown()  # gloo's workers idle, then the process groups torn down: no rank dies at exit (rc 250)
