"""The analytic step time of a flush step whose backward is split (zero-bubble schedules, e.g.
ZB-H1): lower bounds on the paths the step cannot shorten, and what each stage's I and W cost as
the engine runs them (:func:`split_stage_times`). Pure Python; :mod:`.model` uses it."""

from __future__ import annotations

from typing import Sequence


def split_extra(model, lay, s: int, k) -> float:
    """What stage s's split backward costs beyond its whole backward, at the profile's batch size:
    its layers' ``split_extra`` (the engine's I + W over the whole backward, measured by the
    profilers), but the model's first part's when its data needs no gradient (its whole backward
    runs as W, one autograd call) and the layers re-computed with prefix ``k`` (a re-entrant checkpoint
    runs their whole backward inside I)."""
    if not model.any_split_extra:
        return 0.0
    chosen = set(lay.rec[s].layers(k))
    first = lay.parts[1] if s == 0 and model.first_whole else 0  # stage 0's first chunk is the model's first part
    return sum(model.extra[i] for a, b in lay.chunk_ranges(s) for i in range(max(a, first), b) if i not in chosen)


def split_stage_times(model, lay, f: float, ks: Sequence, B: Sequence[float]) -> tuple[list[float], list[float]]:
    """(I, W) per stage of a split backward as the engine runs it, at batch factor ``f`` (one
    chunk's with v chunks per stage): W the stage's parameter-gradient part (the first stage's
    whole backward; a re-computed layer's W runs in I), I the rest of the backward ``B``
    (re-computation included) plus :func:`split_extra`, the second autograd pass's cost. W is at
    most ``B`` (a profile edited by hand may give a layer more W than backward; the simulator's
    costs clamp it alike, :mod:`.sim_costs`)."""
    v = lay.v
    W = [min(f * (lay.wgt[s] - lay.moved(s, ks[s])) / v, B[s]) for s in range(lay.K)]
    return [B[s] - W[s] + f * split_extra(model, lay, s, ks[s]) / v for s in range(lay.K)], W


def split_backward_time(
    F: Sequence[float], I: Sequence[float], W: Sequence[float], c: Sequence[float], M: int, in_flight: Sequence[int]
) -> float:
    """Compute time of a flush step whose backward is split into I (the input gradient the
    previous stage waits for) and W (the parameter gradients nobody waits for), e.g. ZB-H1.

    The largest of five lower bounds, each a path the step cannot shorten, so the estimate is
    never more than the real step time (a safe bound for pruning) and, for equal stages, equals
    ZB-H1's M (F+I+W) + (K-1) max(F, I, F+I-W): the paper's bubble (K-1)(F+I-W) when
    W <= I, and a forward (or input pass) per stage when W is larger. ``c[s]`` is the transfer
    from stage s to s+1 (its receiver waits for it); stage s holds at most ``in_flight[s]``
    micro-batches (forwards whose W has not run).

    1. stage s works M (F+I+W) after its first input arrives (the last stage's fill: (K-1) F);
    2. stage s cannot start its first I before micro-batch 0 went through every forward and
       back to it; it then still runs every I and W and the forwards beyond its in-flight
       count (the first stage's wait: (K-1) I);
    3. stage 0 starts the last forward only after the I and W of the M - in_flight[0]
       micro-batches it no longer holds; the last micro-batch then goes through every
       forward and input pass and stage 0 runs its W;
    4. stage s ends its last I after all its F's and I's and the W's of the micro-batches it
       no longer holds at its last forward; that micro-batch's I then goes back to stage 0,
       which runs its W (from the last stage: the paper's (K-1)(F+I-W));
    5. a slow link: the compiler posts a stage's activation send after the gradient receive of
       the same step, so after its first I stage s waits, per further forward, for its gradient
       and its activation to cross link s one after the other, with stage s+1's F and I (and
       its own gradient receive) between them; then it still runs its remaining I's and W's.
    """
    K = len(F)
    inbound = [c[s - 1] if s else 0.0 for s in range(K)]
    fill = [0.0] * K  # when stage s's first input has arrived
    for s in range(1, K):
        fill[s] = fill[s - 1] + F[s - 1] + c[s - 1]
    links, forwards = sum(c), sum(F)
    back = [0.0] * (K + 1)  # back[s]: micro-batch 0's way back from the last stage to stage s
    for s in range(K - 1, -1, -1):
        back[s] = back[s + 1] + c[s] + (I[s + 1] if s + 1 < K else 0.0)

    def first_input_pass(s: int) -> float:  # the earliest start of stage s's first I
        return forwards + links + back[s]

    busy = max(fill[s] + M * (F[s] + I[s] + W[s]) + (M - 1) * inbound[s] + M * c[s] for s in range(K))
    drain = max(
        first_input_pass(s) + M * (I[s] + W[s]) + (M - 1) * c[s] + max(0, M - in_flight[s]) * (F[s] + inbound[s])
        for s in range(K)
    )
    done = max(0, M - in_flight[0])  # micro-batches stage 0 finished before its last forward
    last_forward = (M - 1) * F[0] + done * (I[0] + W[0])
    if done:
        last_forward = max(
            last_forward,
            first_input_pass(0) + done * (I[0] + W[0]) + (done - 1) * c[0] + max(0, M - 1 - in_flight[0]) * F[0],
        )
    round_trip = last_forward + forwards + sum(I) + 2 * links + W[0]
    back_to_0 = [0.0] * K  # the input passes and transfers from stage s back to stage 0
    for s in range(1, K):
        back_to_0[s] = back_to_0[s - 1] + I[s - 1] + c[s - 1]
    last_input = (
        max(
            fill[s]
            + M * (F[s] + I[s])
            + max(0, M - in_flight[s]) * W[s]
            + (M - 1) * inbound[s]
            + M * c[s]
            + back_to_0[s]
            for s in range(K)
        )
        + W[0]
    )
    link = 0.0
    for s in range(K - 1):
        loops = max(0, M - in_flight[s])
        link = max(
            link,
            first_input_pass(s) + loops * (2 * c[s] + F[s + 1] + I[s + 1] + c[s + 1]) + (M - loops) * (I[s] + W[s]),
        )
    return max(busy, drain, round_trip, last_input, link)
