"""python -m tools.bench staleness (the single-process study of delay corrections): its rules say
which stages are delayed, and a short run of each layout trains what the rule says."""

from types import SimpleNamespace

import pytest

from tools.bench.studies.staleness import parse_rule, run_one


def test_rules_name_the_delayed_stages():
    assert parse_rule("sync", 3)["delayed"] == []
    assert parse_rule("hippie:extrapolate=1", 3)["delayed"] == [0]
    assert parse_rule("2bw:none", 3)["delayed"] == [0, 1, 2]
    # 2bw under extrapolate-made: the last stage computes on the weights it has made (synchronous)
    assert parse_rule("2bw-made:extrapolate=1", 3)["delayed"] == [0, 1]
    assert parse_rule("stage=2:none", 3)["delayed"] == [2]
    assert parse_rule("2bw-made:nadam=0.99+extrapolate=1", 2)["methods"] == {"nadam": 0.99, "extrapolate": 1.0}
    for bad in ("stage=3:none", "stage=x:none", "2bw-made", "2bw:unknown=1", "2bw:ef"):
        with pytest.raises(SystemExit):
            parse_rule(bad, 3)


class _Bar:
    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass


def test_layouts_train_what_they_say():
    args = SimpleNamespace(stages=2, lr=1e-3, optimizer="adamw", muon_lr=0.02, device="cpu", threads=1)

    def final(rule):
        return run_one("vgg", parse_rule(rule, 2), 0, args, 12, _Bar())["final"]["loss"]

    sync, made, hippie = final("sync"), final("2bw-made:extrapolate=1"), final("hippie:extrapolate=1")
    # at 2 stages 2bw-made delays stage 0 only: hippie's deferred stage, the same rule to the bit
    assert made == hippie
    assert made != sync
    # each stage's delay alone is a different run, and neither is the synchronous one
    first, last = final("stage=0:none"), final("stage=1:none")
    assert len({sync, first, last}) == 3
    # NAdamW on the delayed stage changes its update
    assert final("2bw-made:extrapolate=1+nadam=0.99") != made


def test_2bw_pairing_computes_on_weights_one_update_old():
    """weights=1: step t computes on W(t-1) (W(0) at steps 0 and 1) and updates W(t) at once: its first
    loss is the synchronous one, its run is neither the synchronous one nor hippie's pairing (step t-1's
    gradient applied at step t)."""
    args = SimpleNamespace(stages=2, lr=1e-3, optimizer="adamw", muon_lr=0.02, device="cpu", threads=1)

    def run(rule):
        record = run_one("vgg", parse_rule(rule, 2), 0, args, 12, _Bar())
        return record["train_loss"], record["final"]["loss"]

    (sync_losses, sync), (losses, final) = run("sync"), run("2bw-made:weights=1+extrapolate=1")
    assert losses[0] == sync_losses[0] and losses != sync_losses
    assert final != sync and final != run("2bw-made:extrapolate=1")[1]
