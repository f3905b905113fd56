"""One op table drives every dispatch over op kinds: each kind has an ``OP_INFO`` entry
(hippie_ds/schedules/ir.py) naming an engine handler that takes exactly the entry's arguments, and a
row in ``op_rules.RULES`` with an explicit simulator entry and an explicit entry for each static
checker. A new kind missing one of them fails here (single process)."""
import dataclasses
import inspect

import pytest
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine

from hippie_ds import schedules
from hippie_ds.adapter import instructions as hs
from hippie_ds.adapter.engine import HippiePipelineEngine
from hippie_ds.schedules import continuous_checks, deadlock, simulator, stage_checks
from hippie_ds.schedules.compiler import inference_stream
from hippie_ds.schedules.op_rules import RULES
from hippie_ds.schedules.ir import (DEEPSPEED_INSTRUCTIONS, HANDLER_ARG_FIELDS, OP_INFO, PIPELINE_COLLECTIVE_KINDS, Op,
                                    OpKind, handler_kwargs)

KINDS = list(OpKind)
# each analysis's entry of a RULES row and the class whose methods it names
ANALYSES = {"simulate": simulator._Sim, "stage": stage_checks._StageChecker,
            "continuous": continuous_checks.ContinuousStageChecker, "communicate": deadlock._Simulation}


def _missing(table) -> list:
    """The op kinds ``table`` has no entry for (an entry may be empty: explicitly nothing to do)."""
    return [k for k in OpKind if k not in table]


def _names(entry) -> tuple:
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _handlers(info):
    """(instruction class name, handler name) pairs of a table entry."""
    yield info.instruction, info.handler
    if info.nonblocking_instruction or info.nonblocking_handler:
        yield info.nonblocking_instruction, info.nonblocking_handler


def _example(kind: OpKind, blocking: bool = True) -> Op:
    return Op(kind, stage=0, step=0, micro_batch=2 if OP_INFO[kind].micro_batch else None,
              buffer=1 if OP_INFO[kind].micro_batch else None, blocking=blocking,
              target={OpKind.START_ALLREDUCE: "chunk", OpKind.WAIT_ALLREDUCE: "grads"}.get(kind),
              batch=-1, version=0 if kind in (OpKind.STASH_WEIGHTS, OpKind.FREE_WEIGHTS) else None, chunk=1)


def test_the_coverage_check_catches_a_missing_entry():
    table = {k: "x" for k in OpKind}
    assert _missing(table) == []
    del table[OpKind.WAIT_SENDS]
    assert _missing(table) == [OpKind.WAIT_SENDS]


def test_every_op_kind_has_a_table_entry():
    assert _missing(OP_INFO) == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_engine_handler_exists_and_takes_exactly_the_table_arguments(kind):
    info = OP_INFO[kind]
    fields = {f.name for f in dataclasses.fields(Op)}
    for arg in info.args:
        assert HANDLER_ARG_FIELDS.get(arg, arg) in fields, \
            f"OP_INFO[{kind}].args names {arg!r}: not an Op field (or HANDLER_ARG_FIELDS key); Op has {sorted(fields)}"
    assert info.micro_batch == ("buffer_id" in info.args), \
        f"OP_INFO[{kind}]: micro-batch ops, and only they, take DeepSpeed's buffer_id"
    assert bool(info.nonblocking_instruction) == bool(info.nonblocking_handler), \
        f"OP_INFO[{kind}]: nonblocking_instruction and nonblocking_handler go together"
    for cls_name, name in _handlers(info):
        handler = getattr(HippiePipelineEngine, name, None)
        assert callable(handler), f"OP_INFO[{kind}] names handler {name!r}: HippiePipelineEngine has no such method"
        params = list(inspect.signature(handler).parameters.values())[1:]  # self
        assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params), f"{name}: keyword-callable parameters only"
        names = [p.name for p in params]
        required = [p.name for p in params if p.default is p.empty]
        assert set(info.args) <= set(names) and set(required) <= set(info.args), \
            (f"HippiePipelineEngine.{name}{inspect.signature(handler)} for {cls_name}: must take exactly "
             f"OP_INFO[{kind}].args = {info.args} (other parameters only with defaults)")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_instruction_classes_and_arguments_come_from_the_table(kind):
    info = OP_INFO[kind]
    for blocking, (cls_name, handler) in zip((True, False), _handlers(info)):
        op = _example(kind, blocking)
        inst = hs.to_instruction(op)
        assert type(inst).__name__ == cls_name
        assert inst.kwargs == handler_kwargs(op) and list(inst.kwargs) == list(info.args)
        if cls_name in DEEPSPEED_INSTRUCTIONS:  # stock DeepSpeed's own class, untouched
            assert type(inst) is getattr(ds, cls_name)
        else:  # generated, importable by name, DeepSpeed-style docstring from the table
            cls = getattr(hs, cls_name)
            assert type(inst) is cls and cls.__module__ == "hippie_ds.adapter.instructions"
            assert issubclass(cls, ds.BufferOpInstruction if info.micro_batch else ds.PipeInstruction)
            assert "Roughly:" in cls.__doc__ and info.doc in cls.__doc__
        assert HippiePipelineEngine._INSTRUCTION_MAP[type(inst)] is getattr(HippiePipelineEngine, handler)
        inspect.signature(HippiePipelineEngine._INSTRUCTION_MAP[type(inst)]).bind(None, **inst.kwargs)


def test_deepspeed_instructions_are_deepspeeds_and_the_rest_are_new():
    used = {n for info in OP_INFO.values() for n in (info.instruction, info.nonblocking_instruction) if n}
    assert DEEPSPEED_INSTRUCTIONS <= used, f"DEEPSPEED_INSTRUCTIONS names classes no op uses: {DEEPSPEED_INSTRUCTIONS - used}"
    for name in DEEPSPEED_INSTRUCTIONS:
        assert issubclass(getattr(ds, name, type), ds.PipeInstruction), f"{name}: not in deepspeed.runtime.pipe.schedule"
    assert set(hs.NEW_CLASSES) == used - DEEPSPEED_INSTRUCTIONS
    # DeepSpeed's own map is kept under the table's entries (stock code keeps working)
    assert set(PipelineEngine._INSTRUCTION_MAP) <= set(HippiePipelineEngine._INSTRUCTION_MAP)


def test_the_loop_receives_each_op_explicitly():
    for name, stages in (("1f1b", 3), ("zb-v", 2), ("2bw", 3)):
        compiled = schedules.compile(name, stages, 4)
        declared = hs.DeclaredSchedule(compiled, 1)
        pairs = [pair for step in declared.op_steps() for pair in step]
        assert [op for _, op in pairs] == list(compiled.ops(1))
        assert all(type(inst) is hs.instruction_class(op) and not hasattr(inst, "op") for inst, op in pairs)
        assert [inst for step in declared.steps() for inst in step] == [inst for inst, _ in pairs]  # DeepSpeed's view
        drain = [op for step in declared.drain.op_steps() for _, op in step]
        assert drain == [op for step in (compiled.drain or [[]] * stages)[1] for op in step]
    # eval_batch with virtual stages runs an OpSchedule of the forward-only stream (engine_chunks)
    stream = inference_stream(schedules.compile("zb-v", 2, 4).layout, 0, 4)
    pairs = [pair for step in hs.OpSchedule(stream, 4, 2, 0, num_buffers=2).op_steps() for pair in step]
    assert [op for _, op in pairs] == [op for step in stream for op in step]
    assert {type(inst).__name__ for inst, _ in pairs} >= {"ForwardPass", "ISendActivation"}


def test_every_kind_has_an_analysis_row():
    assert _missing(RULES) == [], ("hippie_ds/schedules/op_rules.py: add the op kind's row (an empty entry where "
                                   "an analysis has nothing to do)")


@pytest.mark.parametrize("analysis", list(ANALYSES))
def test_every_analysis_entry_names_a_method_of_its_analysis(analysis):
    cls = ANALYSES[analysis]
    for kind, rules in RULES.items():
        for name in _names(getattr(rules, analysis)):
            assert callable(getattr(cls, name, None)), \
                f"op_rules.RULES[{kind}].{analysis} names {name!r}: {cls.__name__} has no such method"


def test_pipeline_collectives_wait_for_every_stage_in_both_analyses():
    # the flag (OP_INFO pipeline_collective) and the rows say the same
    assert {k for k, r in RULES.items() if r.simulate == "_exec_collective"} == PIPELINE_COLLECTIVE_KINDS
    assert {k for k, r in RULES.items() if r.communicate == "_collective"} == PIPELINE_COLLECTIVE_KINDS
