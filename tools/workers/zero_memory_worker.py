"""Rank script of ``tools/bench.py zero-memory``: the training state each rank holds, per precision
and optimizer path, after a few steps of the GPT example (2 stages x 2 replicas).

Each engine named in ``--engines`` (``PRECISION:SCHEDULE``; ``stock`` is ``deepspeed.initialize``)
is built, trained ``--steps`` steps (no ``drain()``: what a run holds between steps) and measured:
every live tensor of the process (``gc``), each storage counted once, split into the module's
parameters, their ``.grad`` and the rest (optimizer state, fp32 masters, flat partitions and
accumulators, hippie-ds's gradient buffer). Activations are freed between steps, so this is the
state a precision or ZeRO changes, not the peak. Writes OUT/ENGINE/rankR.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import deepspeed
import torch

import hippie_ds
from examples import gpt

PRECISIONS = {
    "fp32": {},
    "fp32-zero1": {"zero_optimization": {"stage": 1}},  # DeepSpeedZeroOptimizer
    # BF16_Optimizer (fp32 gradient accumulation)
    "bf16-zero1": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                   "data_types": {"grad_accum_dtype": "fp32"}},
    "bf16-plain-zero1": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},  # DeepSpeedZeroOptimizer
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--engines", required=True, help="PRECISION:SCHEDULE,... (SCHEDULE stock: deepspeed.initialize)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    return p.parse_args()


def state_bytes(module) -> dict[str, int]:
    """Bytes of every live tensor storage, each once: the module's parameters, their gradients, the rest."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    grads = {p.grad.untyped_storage().data_ptr() for p in module.parameters() if p.grad is not None}
    seen, out, largest = set(), {"params": 0, "grads": 0, "other": 0}, []
    gc.collect()
    for obj in gc.get_objects():
        try:
            if not torch.is_tensor(obj) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - objects gc sees mid-teardown
            continue
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in seen:
            continue
        seen.add(ptr)
        kind = "params" if ptr in params else "grads" if ptr in grads else "other"
        out[kind] += storage.nbytes()
        if kind == "other":
            largest.append((storage.nbytes(), str(obj.dtype), list(obj.shape)))
    out["largest_other"] = sorted(largest, reverse=True)[:4]  # (bytes, dtype, shape): what the rest is
    return out


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    for engine_name in args.engines.split(","):
        precision, schedule = engine_name.split(":")
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 10 ** 6,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, **PRECISIONS[precision]}
        if schedule != "stock":
            cfg["pipeline"] = {"schedule": schedule}
        torch.manual_seed(0)
        topology = hippie_ds.make_topology(2, torch.distributed.get_world_size())
        specs = gpt.layer_specs(args.vocab, args.dim, args.layers, seq_len=args.seq_len)
        module = deepspeed.pipe.PipelineModule(layers=specs, loss_fn=gpt.lm_loss, topology=topology,
                                               partition_method="parameters")
        init = deepspeed.initialize if schedule == "stock" else hippie_ds.initialize
        engine, *_ = init(model=module, config=cfg, model_parameters=[p for p in module.parameters()])
        g = torch.Generator().manual_seed(engine.grid.data_parallel_id)

        def batches():
            while True:
                ids = torch.randint(0, args.vocab, (2, args.seq_len + 1), generator=g)
                yield ids[:, :-1], ids[:, 1:]
        data = batches()
        for _ in range(args.steps):
            engine.train_batch(data)
        measured = state_bytes(engine.module)
        own = sum(p.numel() for p in engine.module.parameters())
        record = {"engine": engine_name, "rank": rank, "stage": engine.stage_id, "optimizer":
                  type(engine.optimizer).__name__, "parameters": own, **measured,
                  "total": sum(v for k, v in measured.items() if k != "largest_other")}
        os.makedirs(os.path.join(args.out, engine_name), exist_ok=True)
        with open(os.path.join(args.out, engine_name, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
        if rank == 0:
            print(f"[zero-memory] {engine_name}: {record}", flush=True)
        del engine, module, data
        gc.collect()
    hippie_ds.shutdown()


if __name__ == "__main__":
    main()
