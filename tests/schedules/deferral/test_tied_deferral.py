"""``hippie.deferred_layers``' default, "untied", on a model in Megatron-DeepSpeed's shape: a
parameterless first layer, then a word embedding tied to the output head on the last stage. The
default delays a deferred stage's first layer with parameters that is not tied to another stage
(the first transformer block), and the tied embedding stays in-step on every holder; an explicit
1 still delays exactly the first layer with parameters, the tied embedding, and so the head's copy
too. Read through what start-up uses: ``deferred_layers.resolve_for_module`` (the value checked,
the module's layers read) -> the one pass (hippie_ds/schedules/resolve.py, the pure decision in
global layer indices) -> the schedule that runs and the engine's ``split_deferred``. No processes: the stand-in has
every stage's layers built, as ``layers_with_parameters`` gathers them over the world."""

from types import SimpleNamespace

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from hippie_ds.adapter.module.deferred_layers import resolve_for_module, tied_across_stages
from hippie_ds.adapter.gradients.stage import split_deferred
from hippie_ds.config import ConfigError, DEFAULT_DEFERRED_LAYERS, UNTIED_LAYERS, split_config
from hippie_ds.schedules import compile as compile_schedule, load_spec
from hippie_ds.schedules.deferral import StageLayers, delayed_layers
from hippie_ds.schedules.resolve import Shape


class Embedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(8, 4)
        self.position_embeddings = torch.nn.Embedding(4, 4)


def _to_float(x):
    return x


def _logits(embedding, x):
    return x @ embedding.word_embeddings.weight.t()


def megatron(parts=(0, 4, 8)):
    """[_to_float, embed (tied), Block, Block | Block, Block, LayerNorm, embed (tied, the head)]
    on 2 stages; built as every rank's stage builds it (the head's copy reached through a function)."""
    tied = dict(tied_weight_attr="word_embeddings.weight")
    specs = (
        [_to_float, TiedLayerSpec("embed", Embedding, **tied)]
        + [LayerSpec(torch.nn.Linear, 4, 4)] * 4
        + [LayerSpec(torch.nn.LayerNorm, 4), TiedLayerSpec("embed", Embedding, forward_fn=_logits, **tied)]
    )
    embed = [Embedding(), Embedding()]  # stage 0's copy, the last stage's
    built = (
        [_to_float, embed[0]]
        + [torch.nn.Linear(4, 4) for _ in range(4)]
        + [torch.nn.LayerNorm(4)]
        + [lambda x: _logits(embed[1], x)]
    )
    owner = lambda idx: next(s for s in range(len(parts) - 1) if parts[s] <= idx < parts[s + 1])  # noqa: E731
    return SimpleNamespace(
        parts=list(parts),
        num_stages=len(parts) - 1,
        stage_id=0,
        _layer_specs=specs,
        forward_funcs=built,
        _local_start=0,
        stage_owner=owner,
        tied_comms={"embed": {}},
        tied_modules={"embed": embed[0]},
    )


HIPPIE = compile_schedule("hippie", 2, 4)  # stage 0 deferred ('auto': the first half)


def _decided(value=None, model=None, compiled=HIPPIE):
    """(schedule run, Deferral) as start-up decides them for ``hippie.deferred_layers: value``
    (``compiled``: the schedule and shape asked for, its parameters as given)."""
    options = split_config({} if value is None else {"hippie": {"deferred_layers": value}})[2]
    resolved = resolve_for_module(
        megatron() if model is None else model,
        options,
        load_spec(compiled.name),
        Shape(compiled.stages, compiled.micro_batches),
        dict(compiled.params),
    )
    return resolved.compiled, resolved.deferral


def _untied(flags, tied):
    """The "untied" rule on one stage: the global indices of the layers it delays."""
    layers = {0: StageLayers(0, tuple(flags), tuple("embed" if t else None for t in tied))}
    return delayed_layers([0], UNTIED_LAYERS, layers)[0].layers


def test_default_is_untied_and_users_can_write_it():
    assert DEFAULT_DEFERRED_LAYERS == UNTIED_LAYERS == "untied"
    assert split_config({"hippie": {"deferred_layers": "untied"}})[2].deferred_layers == "untied"
    with pytest.raises(
        ConfigError,
        match=r'"hippie.deferred_layers" = \'tied\': .*allowed: "untied" \(the first layer '
        r"with parameters not tied to another stage, the default\)",
    ):
        split_config({"hippie": {"deferred_layers": "tied"}})


def test_untied_skips_modules_tied_to_another_stage():
    # [function, tied embedding, block, block]: the first block
    assert _untied([False, True, True, True], [False, True, False, False]) == (2,)
    assert _untied([True, True], [False, False]) == (0,)  # nothing tied: the first layer with parameters
    assert _untied([False, True], [False, True]) == ()  # only a tied module: nothing delayed
    assert tied_across_stages(megatron()) == [False, True, False, False, False, False, False, True]
    # tied within one stage: an ordinary layer
    assert tied_across_stages(megatron(parts=(0, 8))) == [False] * 8


def test_default_delays_the_first_block_not_the_tied_embedding_nor_the_head():
    """The regression: the old default (1) delayed stage 0's embedding and, by the one rule per
    tied module, the head's weights on the last stage; the default keeps both in-step."""
    compiled, deferral = _decided()
    # the first block (global index 2): the embedding stays in-step; the head's stage is not made deferred
    assert compiled.deferred_stages() == [0] and deferral.stages[0].layers == (2,) and not deferral.stages[0].whole
    assert deferral.tied_delayed == set() and deferral.tied_kept == {"embed"}
    model = megatron()
    params = [p for f in model.forward_funcs[:4] if isinstance(f, torch.nn.Module) for p in f.parameters()]
    tied = list(model.tied_modules["embed"].parameters())
    late, in_step = split_deferred(params, model.forward_funcs[:4], 0, deferral.stages[0])
    block = list(model.forward_funcs[2].parameters())
    assert [id(p) for p in late] == [id(p) for p in block]  # the first block alone
    assert {id(p) for p in in_step} == {id(p) for p in tied + list(model.forward_funcs[3].parameters())}


def test_explicit_one_still_delays_the_tied_embedding_and_its_head():
    compiled, deferral = _decided(1)
    # the embedding (index 1): exactly one layer with parameters; the head's holder delays it too
    assert compiled.deferred_stages() == [0, 1] and deferral.stages[0].layers == (1,)
    assert deferral.stages[1].layers == () and deferral.stages[1].tied_keys == {"embed"}
    assert deferral.tied_delayed == {"embed"} and deferral.tied_kept == set()
    compiled, deferral = _decided(2)
    assert deferral.stages[0].layers == (1, 2) and deferral.tied_delayed == {"embed"}


def test_untied_applies_only_to_schedules_with_deferred_stages():
    compiled, deferral = _decided(compiled=compile_schedule("1f1b", 2, 4))
    assert deferral.stages == {} and deferral.tied_delayed == deferral.tied_kept == set()
    with pytest.raises(
        ConfigError,
        match=r'"hippie.deferred_layers" = \'untied\': schedule \'1f1b\' has no '
        r"deferred stages",
    ):
        _decided("untied", compiled=compile_schedule("1f1b", 2, 4))


def test_a_stage_holding_only_the_tied_embedding_delays_nothing():
    """4 stages ([_to_float, embed] | 2 blocks | 2 blocks | LayerNorm, head): stage 0 has no
    untied layer with parameters, so it delays nothing (an ordinary stage), stage 1 its first block."""
    hippie = compile_schedule("hippie", 4, 4)  # stages 0 and 1 deferred
    assert hippie.deferred_stages() == [0, 1]
    compiled, deferral = _decided(model=megatron(parts=(0, 2, 4, 6, 8)), compiled=hippie)
    assert compiled.deferred_stages() == [1] and deferral.stages[1].layers == (2,)
    assert deferral.tied_delayed == deferral.tied_kept == set()  # no deferred stage holds it
