"""One op table drives every dispatch over op kinds: each kind has an ``OP_INFO`` entry
(hippie_ds/schedules/ir.py), an engine handler (``HANDLERS``, adapter/stage/handlers.py) that takes
exactly the entry's arguments, and a
row in ``op_rules.RULES`` whose explicit simulator entry and explicit entry for each static checker
are that analysis's functions themselves (no names resolved by string). A new kind missing one of
them fails here (single process). What each kind means (its cost terms, gradient flags, peer) is read
from the table: no module outside ``ir.py`` and ``op_rules.py`` compares op kinds
(``test_no_op_kind_comparisons_outside_the_op_table``). tests/docs/test_extending_example.py runs this
file on a copy of the package with docs/extending.md's new op kind added."""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine

from hippie_ds import schedules
from hippie_ds.adapter.stage import instructions as hs
from hippie_ds.adapter.engine.engine import HippiePipelineEngine
from hippie_ds.adapter.stage.handlers import HANDLERS, NONBLOCKING_HANDLERS, handler_of
from hippie_ds.schedules import continuous_checks, deadlock, sim_stages, stage_checks
from hippie_ds.schedules.compiler import inference_stream
from hippie_ds.schedules.costs import StageCost
from hippie_ds.schedules.op_rules import RULES, Communication
from hippie_ds.schedules.ir import (
    COMPUTE_KINDS,
    DEEPSPEED_INSTRUCTIONS,
    HANDLER_ARG_FIELDS,
    OP_INFO,
    PIPELINE_COLLECTIVE_KINDS,
    UPDATE_KINDS,
    Op,
    OpKind,
    handler_kwargs,
)

KINDS = list(OpKind)
# each analysis's entry of a RULES row and the class whose functions it holds
ANALYSES = {
    "simulate": sim_stages._Sim,
    "stage": stage_checks._StageChecker,
    "continuous": continuous_checks.ContinuousStageChecker,
    "communicate": deadlock._Simulation,
}
ANALYSIS_MODULES = ("sim_stages.py", "stage_checks.py", "continuous_checks.py", "deadlock.py")


def _missing(table) -> list:
    """The op kinds ``table`` has no entry for (an entry may be empty: explicitly nothing to do)."""
    return [k for k in OpKind if k not in table]


def _functions(entry) -> tuple:
    """The functions an entry of a RULES row holds: one, several in order, or a communication
    rule's function and its reports."""
    if isinstance(entry, Communication):
        return tuple(f for f in entry if f is not None)
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _handlers(kind):
    """(instruction class name, handler) pairs of a kind: its table entry's classes, its HANDLERS entries."""
    info = OP_INFO[kind]
    yield info.instruction, HANDLERS.get(kind)
    if info.nonblocking_instruction or kind in NONBLOCKING_HANDLERS:
        yield info.nonblocking_instruction, NONBLOCKING_HANDLERS.get(kind)


def _example(kind: OpKind, blocking: bool = True) -> Op:
    return Op(
        kind,
        stage=0,
        step=0,
        micro_batch=2 if OP_INFO[kind].micro_batch else None,
        buffer=1 if OP_INFO[kind].micro_batch else None,
        blocking=blocking,
        target={OpKind.START_ALLREDUCE: "chunk", OpKind.WAIT_ALLREDUCE: "grads"}.get(kind),
        batch=-1,
        version=0 if kind in (OpKind.STASH_WEIGHTS, OpKind.FREE_WEIGHTS) else None,
        chunk=1,
    )


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
        assert HANDLER_ARG_FIELDS.get(arg, arg) in fields, (
            f"OP_INFO[{kind}].args names {arg!r}: not an Op field (or HANDLER_ARG_FIELDS key); Op has {sorted(fields)}"
        )
    assert info.micro_batch == ("buffer_id" in info.args), (
        f"OP_INFO[{kind}]: micro-batch ops, and only they, take DeepSpeed's buffer_id"
    )
    assert bool(info.nonblocking_instruction) == (kind in NONBLOCKING_HANDLERS), (
        f"OP_INFO[{kind}]: nonblocking_instruction and a NONBLOCKING_HANDLERS entry go together"
    )
    for cls_name, handler in _handlers(kind):
        assert callable(handler), f"{kind} ({cls_name}): no handler in adapter/stage/handlers.py's HANDLERS"
        name = handler.__name__
        params = list(inspect.signature(handler).parameters.values())[1:]  # the stage runtime
        assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params), f"{name}: keyword-callable parameters only"
        names = [p.name for p in params]
        required = [p.name for p in params if p.default is p.empty]
        assert set(info.args) <= set(names) and set(required) <= set(info.args), (
            f"handlers.{name}{inspect.signature(handler)} for {cls_name}: must take exactly "
            f"OP_INFO[{kind}].args = {info.args} (other parameters only with defaults)"
        )


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_instruction_classes_and_arguments_come_from_the_table(kind):
    info = OP_INFO[kind]
    for blocking, (cls_name, handler) in zip((True, False), _handlers(kind)):
        op = _example(kind, blocking)
        inst = hs.to_instruction(op)
        assert type(inst).__name__ == cls_name
        assert inst.kwargs == handler_kwargs(op) and list(inst.kwargs) == list(info.args)
        if cls_name in DEEPSPEED_INSTRUCTIONS:  # stock DeepSpeed's own class, untouched
            assert type(inst) is getattr(ds, cls_name)
        else:  # generated, importable by name, DeepSpeed-style docstring from the table
            cls = getattr(hs, cls_name)
            assert type(inst) is cls and cls.__module__ == "hippie_ds.adapter.stage.instructions"
            assert issubclass(cls, ds.BufferOpInstruction if info.micro_batch else ds.PipeInstruction)
            assert "Roughly:" in cls.__doc__ and info.doc in cls.__doc__
        assert handler_of(op) is handler
        inspect.signature(handler).bind(None, **inst.kwargs)


def test_deepspeed_instructions_are_deepspeeds_and_the_rest_are_new():
    used = {n for info in OP_INFO.values() for n in (info.instruction, info.nonblocking_instruction) if n}
    assert DEEPSPEED_INSTRUCTIONS <= used, (
        f"DEEPSPEED_INSTRUCTIONS names classes no op uses: {DEEPSPEED_INSTRUCTIONS - used}"
    )
    for name in DEEPSPEED_INSTRUCTIONS:
        assert issubclass(getattr(ds, name, type), ds.PipeInstruction), (
            f"{name}: not in deepspeed.runtime.pipe.schedule"
        )
    assert set(hs.NEW_CLASSES) == used - DEEPSPEED_INSTRUCTIONS
    # DeepSpeed's own map is the engine's, untouched: instructions of DeepSpeed's own schedules (eval's
    # InferenceSchedule) run DeepSpeed's handlers
    assert HippiePipelineEngine._INSTRUCTION_MAP is PipelineEngine._INSTRUCTION_MAP


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
    assert _missing(RULES) == [], (
        "hippie_ds/schedules/op_rules.py: add the op kind's row (an empty entry where an analysis has nothing to do)"
    )


@pytest.mark.parametrize("analysis", list(ANALYSES))
def test_every_analysis_entry_is_a_function_of_its_analysis(analysis):
    cls = ANALYSES[analysis]
    for kind, rules in RULES.items():
        entry = getattr(rules, analysis)
        if analysis == "communicate":
            assert isinstance(entry, Communication), f"op_rules.RULES[{kind}].communicate: a Communication"
        else:
            shape = "one function" if analysis == "simulate" else "a tuple of functions, in order"
            assert isinstance(entry, tuple) == (analysis != "simulate"), f"op_rules.RULES[{kind}].{analysis}: {shape}"
        for function in _functions(entry):
            name = getattr(function, "__name__", None)
            assert inspect.isfunction(function) and getattr(cls, name, None) is function, (
                f"op_rules.RULES[{kind}].{analysis} holds {function!r}: not a function of {cls.__name__}"
            )


def test_the_analyses_call_their_rules_and_resolve_no_names():
    """The analyses run the table's functions as they are: no method looked up by a name
    (``getattr(self, ...)``), and none of them imports the table (their entry points hand it in)."""
    for name in ANALYSIS_MODULES:
        tree = ast.parse((ROOT / "hippie_ds/schedules" / name).read_text())
        by_name = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "self"
        ]
        assert not by_name, f"hippie_ds/schedules/{name}: getattr(self, ...) at lines {by_name}"
        imports = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
        imports |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {"op_rules", "RULES"} & imports, f"hippie_ds/schedules/{name} imports the op table"


def test_pipeline_collectives_wait_for_every_stage_in_both_analyses():
    # the flag (OP_INFO pipeline_collective) and the rows say the same
    waits = {k for k, r in RULES.items() if "self._rendezvous(" in inspect.getsource(r.simulate)}
    assert waits == PIPELINE_COLLECTIVE_KINDS
    assert {
        k for k, r in RULES.items() if r.communicate.advance is deadlock._Simulation._collective
    } == PIPELINE_COLLECTIVE_KINDS
    update = continuous_checks.ContinuousStageChecker._update
    assert {k for k, r in RULES.items() if update in r.continuous} == UPDATE_KINDS


def test_every_waiting_communication_rule_says_why_it_is_stuck():
    # deadlock._Simulation._stuck calls the stuck report RULES[kind].communicate pairs with its
    # function; a local op never waits, and has no report
    for kind, rules in RULES.items():
        rule = rules.communicate
        if rule.advance is deadlock._Simulation._local:
            assert rule.stuck is None and rule.waiting_on is None, f"RULES[{kind}]: a local op never waits"
        else:
            assert callable(rule.stuck), (
                f"RULES[{kind}].communicate runs {rule.advance.__name__}, which can wait: pair it with its stuck report"
            )


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_what_each_kind_means_is_consistent(kind):
    info = OP_INFO[kind]
    assert all(
        isinstance(getattr(StageCost, term, None), property) or term in StageCost.model_fields for term in info.cost
    ), f"OP_INFO[{kind}].cost = {info.cost}: not all StageCost fields"
    assert (kind in COMPUTE_KINDS) == bool(info.forward or info.input_grad or info.weight_grad)
    if kind in COMPUTE_KINDS:
        assert info.cost, f"OP_INFO[{kind}]: a compute op takes time (cost terms)"
    if info.peer is not None:  # p2p: the two ends agree
        peer = OP_INFO[info.peer]
        assert peer.peer == kind and peer.carries == info.carries and peer.direction == -info.direction
        assert {info.role, peer.role} == {"send", "recv"} and info.carries in ("activation", "gradient")
        assert info.direction in (-1, 1)
    else:
        assert not info.carries and not info.direction
    for p2p, role in ((info.receives, "recv"), (info.sends, "send")):
        assert p2p is None or (OP_INFO[p2p].role == role and OP_INFO[p2p].peer is not None)
    if info.sends is not None:  # a forward's result goes on, a gradient back
        assert (OP_INFO[info.sends].carries == "gradient") == info.input_grad
    assert set(info.steady_state) <= {"compute", "epilogue", "after"}
    assert ("compute" in info.steady_state) <= (kind in COMPUTE_KINDS)
    assert not {"epilogue", "after"} & set(info.steady_state) or info.placeable


# -- no op-kind comparisons outside the op table ------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
TABLE_MODULES = {"hippie_ds/schedules/ir.py", "hippie_ds/schedules/op_rules.py"}
# Modules that still compare kinds, each with how many comparisons it may keep and why. Each entry
# is a debt: the test fails when a module has more, and when it has fewer (shrink the entry then).
ALLOWED: dict[str, int] = {}
_COMPARISONS = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)


def _kind_names(tree: ast.AST) -> set:
    """The names OpKind goes by in a module: its own and aliases (``_K = OpKind``, ``import OpKind as K``)."""
    names = {"OpKind"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname for a in node.names if a.name == "OpKind" and a.asname}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in names:
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_member(node: ast.AST, names: set) -> bool:
    """``OpKind.X``, ``_K.X``, ``ir.OpKind.X``, or their ``.value``."""
    if isinstance(node, ast.Attribute) and node.attr == "value" and _is_member(node.value, names):
        return True
    return (
        isinstance(node, ast.Attribute)
        and node.attr in OpKind.__members__
        and (
            (isinstance(node.value, ast.Name) and node.value.id in names)
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "OpKind")
        )
    )


def _names_kinds(node: ast.AST, names: set) -> bool:
    """A kind, or a literal set / tuple / list holding one."""
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return any(_is_member(e, names) for e in node.elts)
    return _is_member(node, names)


def _kind_spelled(node: ast.AST) -> bool:
    """``x.kind.name`` or ``x.kind.value``: a kind compared by its spelling (``op.kind.name == "FORWARD"``)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in ("name", "value")
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "kind"
    )


def kind_comparisons(source: str) -> list[int]:
    """The lines of ``source`` that compare against op kinds: ==, !=, is, is not, in, not in with a
    kind, a literal collection of kinds or a kind's spelling, and ``match`` cases on kinds."""
    tree = ast.parse(source)
    names, lines = _kind_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(o, _COMPARISONS) for o in node.ops):
            if any(_names_kinds(x, names) or _kind_spelled(x) for x in (node.left, *node.comparators)):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _is_member(node.value, names):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_kind_comparison_scan_catches_each_form():
    caught = """
from .ir import OpKind as K
_K = OpKind
a = op.kind == OpKind.FORWARD
b = op.kind != _K.BACKWARD
c = kind in (OpKind.SEND_GRAD, OpKind.RECV_GRAD)
d = kind not in {K.LOAD}
e = op.kind is ir.OpKind.WAIT_SENDS
f = rule.op in [OpKind.BACKWARD_INPUT.value]
match kind:
    case OpKind.FORWARD:
        pass
g = op.kind.name == "STAGE_OPTIMIZER_STEP"
"""
    assert kind_comparisons(caught) == [4, 5, 6, 7, 8, 9, 11, 13]
    fine = """
a = op.kind in COMPUTE_KINDS
b = OP_INFO[op.kind].forward
c = Op(OpKind.LOAD, 0, 0)
d = {OpKind.FORWARD: 1}.get(kind)
e = op.target == "grads"
"""
    assert kind_comparisons(fine) == []


def test_no_op_kind_comparisons_outside_the_op_table():
    """What differs between kinds lives in OP_INFO (ir.py) and RULES (op_rules.py); everything else
    asks them (a flag, a derived kind set, a per-kind function), so a new kind is a row, not a case."""
    found = {}
    for path in sorted((ROOT / "hippie_ds").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name not in TABLE_MODULES:
            lines = kind_comparisons(path.read_text())
            if lines:
                found[name] = lines
    over = {n: lines for n, lines in found.items() if len(lines) > ALLOWED.get(n, 0)}
    assert over == {}, (
        "op kinds compared outside ir.py / op_rules.py (file: lines); read a flag or a kind set "
        "of OP_INFO, or name a function per kind in op_rules.RULES"
    )
    stale = {n: (len(found.get(n, [])), allowed) for n, allowed in ALLOWED.items() if len(found.get(n, [])) < allowed}
    assert stale == {}, "ALLOWED lists more comparisons than the module has (found, allowed): shrink or drop its entry"
