"""What the validator tests (test_validator.py, test_validator_dataflow.py) edit schedules with: a
compiled schedule whose streams may be changed in place, and how they find, move and remove its ops
and pick out the problems the validator reports at one stage and step."""

from dataclasses import replace

from hippie_ds import schedules


def editable(name, stages, micro_batches, **params):
    """A compiled schedule whose streams the test may edit in place."""
    c = schedules.compile(name, stages, micro_batches, validate=False, **params)
    return replace(c, streams=[[list(step) for step in stream] for stream in c.streams])


def locate(c, stage, kind, mb=None, target=None):
    """(step, index) of the stage's only op of that kind (and micro-batch / target)."""
    hits = [
        (t, i)
        for t, step in enumerate(c.streams[stage])
        for i, op in enumerate(step)
        if op.kind == kind and (mb is None or op.micro_batch == mb) and (target is None or op.target == target)
    ]
    assert len(hits) == 1, hits
    return hits[0]


def op_at(c, stage, pos):
    return c.streams[stage][pos[0]][pos[1]]


def put(c, stage, pos, op):
    """Place op at pos (step, index), keeping its step field consistent with where it is."""
    c.streams[stage][pos[0]][pos[1]] = replace(op, step=pos[0])


def swap(c, stage, a, b):
    op_a, op_b = op_at(c, stage, a), op_at(c, stage, b)
    put(c, stage, a, op_b)
    put(c, stage, b, op_a)


def remove(c, stage, pos):
    return c.streams[stage][pos[0]].pop(pos[1])


def problems_with(problems, stage, step, *words):
    """The problems at (stage, step) whose reason contains every word."""
    return [p for p in problems if p.stage == stage and p.step == step and all(w in p.reason for w in words)]
