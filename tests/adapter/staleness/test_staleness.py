"""The one staleness correction (hippie_ds/adapter/staleness/prediction.py) and hippie-ds's checkpoint state
format, without processes: the in-place form on a deferred stage's parameters and the per-version
form of 2bw follow the same rule, W_hat(v) = W(v) + c * (W(v) - W(v-1)); checkpoints of both
earlier shapes (format 1) load into it."""

import torch

from hippie_ds.adapter.checkpoint import state as ckpt
from hippie_ds.adapter.staleness.methods import make_prediction
from hippie_ds.adapter.staleness.prediction import InPlacePrediction, MadeWeightsPrediction, WeightPrediction
from hippie_ds.config import StalenessConfig

C = 1.5


def _updates(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(3, 4, generator=g), torch.randn(5, generator=g)] for _ in range(steps)]


def _run_in_place(params, updates, prediction, seen):
    """One deferred stage's steps: predict, compute (record what it sees), restore, update."""
    for u in updates:
        prediction.predict()
        seen.append([p.detach().clone() for p in params])
        prediction.begin_update()
        with torch.no_grad():
            for p, d in zip(params, u):
                p.sub_(d)
        prediction.end_update()


def _reference(w0, updates, c=C):
    """The rule written out: step t computes on W(t) + c (W(t) - W(t-1)) (W(t) at t = 0)."""
    history, seen = [w0], []
    for t, u in enumerate(updates):
        w = history[-1]
        seen.append(w if t == 0 else [x.clone().add_(x - q, alpha=c) for x, q in zip(w, history[-2])])
        history.append([x - d for x, d in zip(w, u)])
    return seen, history[-1]


def test_in_place_prediction_is_the_rule_and_restores_exactly():
    w0 = [torch.randn(3, 4), torch.randn(5)]
    params = [w.clone() for w in w0]
    prediction, seen = InPlacePrediction(params, C), []
    _run_in_place(params, _updates(5), prediction, seen)
    ref_seen, ref_final = _reference(w0, _updates(5))
    for ours, ref in zip(seen, ref_seen):
        assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_final)), "the updates applied to predicted weights"
    assert len(prediction.deltas) == 1  # one weight-sized buffer between steps


def test_in_place_checkpoint_resumes_bit_identically_in_both_formats():
    w0 = [torch.randn(3, 4), torch.randn(5)]
    updates = _updates(6, seed=1)
    full = [w.clone() for w in w0]
    full_seen = []
    _run_in_place(full, updates, InPlacePrediction(full, C), full_seen)

    params = [w.clone() for w in w0]
    first = InPlacePrediction(params, C)
    _run_in_place(params, updates[:3], first, [])
    state = first.state_dict()
    assert state["format"] == 2
    # format 1 of a deferred stage saved W(t-1), the weights before the last update
    previous = [p - d for p, d in zip(params, first.deltas[0])]
    old_state = {"coefficient": C, "previous": [q.clone() for q in previous]}
    for saved in (state, old_state):
        resumed_params = [p.clone() for p in params]
        resumed, seen = InPlacePrediction(resumed_params, C), []
        resumed.load_state_dict(saved, "cpu")
        _run_in_place(resumed_params, updates[3:], resumed, seen)
        if saved is state:  # format 2 carries the delta itself: bit-identical
            assert all(torch.equal(a, b) for a, b in zip(resumed_params, full))
        else:  # format 1: delta = W - W_previous, as the old prediction computed it; W_previous
            # here is made from the delta, W - (W - delta), so equal within rounding
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(resumed_params, full))


def test_per_version_prediction_and_its_format1_state():
    prediction = WeightPrediction(C)
    w = torch.randn(7)
    assert prediction.predicted(1, [w]) is None and not prediction.knows(1)
    delta = torch.randn(7)
    prediction.record(1, [delta])
    [hat] = prediction.predicted(1, [w])
    assert torch.equal(hat, torch.add(w, delta, alpha=C))
    prediction.record(2, [torch.randn(7)])
    prediction.keep_only({2})
    assert sorted(prediction.deltas) == [2]
    # 2bw's format 1: {"deltas": {version: flat}}
    old = WeightPrediction(C)
    old.load_state_dict({"deltas": {"3": delta}}, "cpu")
    assert torch.equal(old.predicted(3, [w])[0], hat)
    new = WeightPrediction(C)
    new.load_state_dict(old.state_dict(), "cpu")
    assert torch.equal(new.predicted(3, [w])[0], hat)


def test_no_correction_is_none():
    assert make_prediction(StalenessConfig(method="none"), [torch.zeros(1)]) is None
    assert make_prediction(None) is None
    assert isinstance(make_prediction(StalenessConfig(), [torch.zeros(1)]), InPlacePrediction)
    assert type(make_prediction(StalenessConfig())) is MadeWeightsPrediction  # 2bw's default: extrapolate-made
    assert type(make_prediction(StalenessConfig(method="extrapolate"))) is WeightPrediction


def test_checkpoint_state_format_and_format1_keys():
    empty = {"state": "empty", "buffer": None}
    state = ckpt.training_state(empty, None, {"format": 2, "coefficient": 1.0, "deltas": {}})
    assert not isinstance(state, ckpt.InFlightState) and state["format"] == ckpt.STATE_FORMAT
    filled = ckpt.training_state({"state": "reduced", "buffer": torch.ones(2)}, None, None)
    assert isinstance(filled, ckpt.InFlightState)
    stashed = ckpt.training_state(empty, {"call": 1, "count": 2, "stashed": {1: torch.ones(1)}}, None)
    assert isinstance(stashed, ckpt.InFlightState)
    client = {ckpt.STATE_KEY: filled, "user": 1}
    read = ckpt.read_training_state(client)
    assert read["grad_buffer"]["state"] == "reduced" and client == {"user": 1}
    # format 1: three keys, the in-flight ones wrapped
    client = {
        "hippie_ds_grad_buffer": ckpt.InFlightState({"state": "reduced", "buffer": None}),
        "hippie_ds_weight_versions": {"call": 0, "count": 0, "stashed": {}},
        "hippie_ds_weight_prediction": {"coefficient": 1.0, "previous": None},
    }
    read = ckpt.read_training_state(client)
    assert read["grad_buffer"]["state"] == "reduced" and read["weight_versions"]["count"] == 0
    assert read["prediction"]["previous"] is None and client == {}


# ---------------------------------------------------------------------------------------------
# "adam": Adam's own predicted next update (hippie_ds/adapter/staleness/adam.py)


def _adam_hat(opt, p, c):
    """The rule written out: W + c * (-lr) (m / (1 - b1^(k+1)) / (sqrt(s / (1 - b2^(k+1))) + eps) + wd W)."""
    group, state = opt.param_groups[0], opt.state[p]
    (b1, b2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
    k = float(state["step"]) + 1
    m_hat, s_hat = state["exp_avg"] / (1 - b1**k), state["exp_avg_sq"] / (1 - b2**k)
    return p.detach() - c * lr * (m_hat / (s_hat.sqrt() + eps) + wd * p.detach())


def test_adam_in_place_prediction_is_the_rule_and_restores_exactly():
    from hippie_ds.adapter.staleness.adam import AdamInPlacePrediction, source_of

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params, lr=0.01)
    prediction = make_prediction(StalenessConfig(method="adam", coefficient=C), params)
    assert isinstance(prediction, AdamInPlacePrediction)
    prediction.bind(source_of(opt, C))
    expected = None
    for t in range(4):
        true = [p.detach().clone() for p in params]
        prediction.predict()
        seen = [p.detach().clone() for p in params]
        if expected is None:  # nothing stepped yet: W itself
            assert all(torch.equal(a, b) for a, b in zip(seen, true))
        else:
            assert all(torch.allclose(a, b, atol=1e-7, rtol=0) for a, b in zip(seen, expected))
            assert any((a - b).abs().max() > 1e-4 for a, b in zip(seen, true)), "predicted nothing"
        prediction.begin_update()
        assert all(torch.equal(p, w) for p, w in zip(params, true)), "the update must see the true weights"
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        prediction.end_update()
        expected = [_adam_hat(opt, p, C) for p in params]
    assert len(prediction.deltas) == 1  # one weight-sized buffer between steps
    state = prediction.state_dict()
    assert state["method"] == "adam"
    other = InPlacePrediction([p.detach().clone() for p in params], C)
    other.load_state_dict(state, "cpu")  # an extrapolate run does not take adam's W_hat for a delta
    assert other.deltas == {}


def test_adam_per_version_prediction_reads_the_optimizer():
    from hippie_ds.adapter.staleness.adam import AdamVersionPrediction, source_of

    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    prediction = make_prediction(StalenessConfig(method="adam"))
    assert isinstance(prediction, AdamVersionPrediction)
    prediction.bind(source_of(opt, 1.0), params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    prediction.record(1, None)
    [flat] = prediction.predicted(1, None)
    assert torch.allclose(flat, torch.cat([_adam_hat(opt, p, 1.0).flatten() for p in params]), atol=1e-7, rtol=0)


def test_adam_correction_refuses_optimizers_it_cannot_read():
    import pytest

    from hippie_ds.adapter.staleness.adam import source_of
    from hippie_ds.config import ConfigError

    params = [torch.nn.Parameter(torch.randn(2))]
    for opt in (torch.optim.SGD(params, lr=0.1), torch.optim.AdamW(params, lr=0.1, amsgrad=True)):
        with pytest.raises(ConfigError, match=r'"hippie.staleness.method" = "adam".*torch.optim.AdamW.*"extrapolate"'):
            source_of(opt, 1.0)
    assert source_of(torch.optim.Adam(params, lr=0.1), 1.0).kind == "adam"  # L2 decay: in the moments


def test_adam_per_version_uses_the_made_weights_when_no_compute_has_used_the_version():
    """A version no compute has swapped in when the next update is made computes on W(v) + c
    (W(v+1) - W(v)) (2bw's last stage); one already used keeps Adam's prediction."""
    from hippie_ds.adapter.staleness.adam import source_of

    for used, c in ((False, 1.0), (False, C), (True, 1.0)):
        params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
        opt = torch.optim.AdamW(params, lr=0.02)
        prediction = make_prediction(StalenessConfig(method="adam", coefficient=c))
        prediction.bind(source_of(opt, c), params, made=True)
        flat = lambda: torch.cat([p.detach().flatten() for p in params])  # noqa: E731
        history = [flat()]
        for version in (1, 2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            history.append(flat())
            prediction.record(version, [history[version] - history[version - 1]])
            if version == 1:
                adams = prediction.predicted(1, None)[0].clone()  # Adam's prediction of version 1
                if used:  # a compute swaps version 1 in before update 2
                    assert prediction.knows(1)
        [seen] = prediction.predicted(1, None)
        if used:
            assert torch.equal(seen, adams)
        else:
            assert torch.allclose(seen, history[1] + c * (history[2] - history[1]), atol=1e-7, rtol=0)
            assert c != 1 or torch.equal(seen, history[2])
