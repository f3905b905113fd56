"""``hippie-ds profile`` and ``profile-import``: per-layer profiles of a model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .base import PROG, _Formatter, _add_profile_options, _fmt_bytes, _non_negative_int, _positive_int, _read_profile


def profile_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "profile",
        help="measure a PipelineModule layer list, layer by layer, into a profile",
        formatter_class=_Formatter,
        description="Import TARGET (module:function or path/to/file.py:function; the function returns "
        "(layers, sample): the PipelineModule layer list and one micro-batch of input), run every layer "
        "on the previous layer's output on this machine and write a profile (YAML or JSON): per layer "
        "the median forward and backward time over --repeats runs after --warmup runs, the backward's "
        "parameter-gradient part (backward_weight, for zero-bubble schedules), the re-compute "
        "time, output bytes, bytes saved for backward (saved-tensor hooks, attributed to the layer that "
        "produced them), parameter bytes and, on CUDA, working memory (the allocator's peak beyond what "
        "the layer keeps). A function returning a dict may add 'loss_fn' (the PipelineModule's "
        "loss_fn(outputs, labels)) and 'labels' (one micro-batch of them): the loss is measured the same "
        "way, as the profile's 'loss' entry. Needs torch and DeepSpeed.\n\nexample:\n"
        "  hippie-ds profile tools/examples/gpt.py:profile_target --out gpt-profile.yaml\n"
        "  hippie-ds plan --profile gpt-profile.yaml --cluster 1x4,8GB,10Gbit --global-batch 32 "
        "--out plan.json",
    )
    p.add_argument("target", metavar="TARGET", help="module:function or path/to/file.py:function")
    p.add_argument("--out", "-o", required=True, metavar="FILE", help="profile to write (.json, or .yaml/.yml)")
    p.add_argument("--repeats", type=_positive_int, default=10, metavar="N", help="timed runs per layer (default 10)")
    p.add_argument(
        "--warmup", type=_non_negative_int, default=3, metavar="N", help="untimed runs per layer first (default 3)"
    )
    p.add_argument("--threads", type=_positive_int, metavar="N", help="torch threads (default: torch's)")
    p.add_argument("--name", metavar="NAME", help="model name in the profile (default: what TARGET says, or TARGET)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile)


def _cmd_profile(args) -> int:
    import torch

    from ..planner import save_profile
    from ..profiler import TargetError, load_target_spec, profile_layers

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target = load_target_spec(args.target)
        profile = profile_layers(
            target["layers"],
            target["sample"],
            model=args.name or target["name"],
            repeats=args.repeats,
            warmup=args.warmup,
            progress=not args.no_progress,
            loss_fn=target["loss_fn"],
            labels=target["labels"],
        )
    except TargetError as exc:
        if os.environ.get("HIPPIE_DS_DEBUG"):
            raise
        sys.stderr.write(_target_error_report(args.target, exc))
        return 2
    save_profile(profile, args.out)
    saved = sum(x.saved for x in profile.layers)
    print(
        f"wrote {args.out}: {profile.model}, {profile.num_layers} layers at micro-batch {profile.batch_size}, "
        f"forward+backward {profile.total_time() * 1e3:.4g} ms, saved for backward {_fmt_bytes(saved)}, "
        f"parameters {_fmt_bytes(profile.total_param_bytes())}"
    )
    from ..planner.noise import noise_warning

    warning = noise_warning(profile)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def _target_error_report(target: str, error) -> str:
    """What ``hippie-ds profile`` prints when the target's own code raised (a ``TargetError``): one
    line naming the target and the exception, then the traceback without hippie-ds's frames, the
    import machinery's, and the library frames (torch, DeepSpeed) that lead into the target's code."""
    import traceback

    exc = error.__cause__
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    try:
        message = str(exc)
    except Exception:
        message = ""
    where = f": {error.where}" if error.where else ""
    head = f"{PROG} profile: target {target!r}{where} raised {name}" + (f": {message}" if message else "")
    report = traceback.TracebackException.from_exception(exc)
    _drop_foreign_frames(report, set())
    return head + "\n" + "".join(report.format())


def _drop_foreign_frames(report, seen: set) -> None:
    """Keep the frames of the user's code in a ``TracebackException`` (and the exceptions chained
    to it): no frame of hippie-ds or of importlib/runpy, and none of the installed libraries before
    the first frame of the user's code (all of them when there is none)."""
    import importlib
    import runpy
    import sysconfig
    import traceback

    if report is None or id(report) in seen:
        return
    seen.add(id(report))

    def inside(filename: str, dirs) -> bool:
        path = os.path.realpath(filename)
        return any(path == d or path.startswith(d + os.sep) for d in dirs)

    ours = [os.path.realpath(Path(__file__).parents[1]), os.path.realpath(Path(importlib.__file__).parent)]
    libraries = {
        os.path.realpath(p)
        for key, p in sysconfig.get_paths().items()
        if key in ("stdlib", "platstdlib", "purelib", "platlib")
    }
    frames = [
        f
        for f in report.stack
        if not (
            f.filename.startswith(("<frozen importlib", "<frozen runpy"))
            or f.filename == runpy.__file__
            or inside(f.filename, ours)
        )
    ]
    first_user = next((i for i, f in enumerate(frames) if not inside(f.filename, libraries)), 0)
    report.stack = traceback.StackSummary.from_list(frames[first_user:])
    for other in (report.__cause__, report.__context__, *(getattr(report, "exceptions", None) or ())):
        _drop_foreign_frames(other, seen)


def profile_import_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "profile-import",
        help="convert a PipeDream graph.txt profile to a hippie-ds profile",
        formatter_class=_Formatter,
        description="Read a per-layer profile (PipeDream graph.txt, or a hippie-ds profile) "
        "and write it as a hippie-ds profile (YAML or JSON): layers in a stable "
        "topological order, times in seconds per micro-batch, the bytes crossing "
        "every cut. Prints a one-line summary.\n\nexample:\n"
        "  hippie-ds profile-import --profile gnmt.txt --out gnmt.yaml",
    )
    _add_profile_options(p)
    p.add_argument("--out", "-o", required=True, metavar="FILE", help="profile to write (.json, or .yaml/.yml)")
    p.set_defaults(func=_cmd_profile_import)


def _cmd_profile_import(args) -> int:
    from ..planner import save_profile

    profile = _read_profile(args)
    save_profile(profile, args.out)
    print(
        f"wrote {args.out}: {profile.model}, {profile.num_layers} layers at batch {profile.batch_size}, "
        f"forward+backward {profile.total_time() * 1e3:.4g} ms, parameters {_fmt_bytes(profile.total_param_bytes())}"
    )
    return 0
