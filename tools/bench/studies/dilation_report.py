"""report.md of ``python -m tools.bench dilation`` (tools/bench/studies/dilation.py). Pure."""

from __future__ import annotations

from tools.bench.report import _f, table
from tools.bench.studies.scaling_plan_report import name_of


def report(results: dict) -> str:
    fits, per_d = results["fits"], results["per_dilation"]
    ds = list(per_d)
    lines = [
        "# Does the time dilation hold? (python -m tools.bench dilation)",
        "",
        f"The scaling study's emulated cluster at {results['nodes']} nodes, each schedule run at every "
        f"dilation D, its step divided back by D (emulated figures). Fit: T(D) = T_inf + h / D (least squares "
        f"in 1/D) over the D of at least {results.get('fitted_from_dilation', 0):g} (each rank has a core of "
        "host or more; below, the waits grow faster than 1/D); excess = T(D) / T_inf - 1 of the fitted line. "
        f"Command: `{results['command']}`. Commit "
        f"{(results.get('source') or {}).get('commit', '?')[:7]}; machine "
        f"{(results.get('machine') or {}).get('cpu')}, {(results.get('machine') or {}).get('cores')} cores.",
        "",
    ]
    lines += [
        "T(D) per row: its step at each D (/ D), the fitted line, the excess of the line at each D, and the "
        f"smallest D measured whose excess is within {results['within']:.0%} (the D the scaling study's row "
        "needs; - where no two D of at least the fitted-from D ran).",
        "",
    ]
    head = (
        ["schedule"]
        + [f"D = {d}: step (s)" for d in ds]
        + ["T_inf (s)", "h (s)"]
        + [f"excess at D = {d}" for d in ds]
        + [f"smallest D within {results['within']:.0%}"]
    )
    per_row = results.get("smallest_dilation_per_row") or {}
    body = []
    for name in dict.fromkeys([*fits, *(n for e in per_d.values() for n in e["rows"])]):
        fit = fits.get(name)
        good = fit is not None and fit["t_inf"] > 0
        body.append(
            [name_of(name)]
            + [_f((per_d[d]["rows"].get(name) or {}).get("step_s"), "{:.3f}") for d in ds]
            + [_f(fit and fit["t_inf"], "{:.3f}"), _f(fit and fit["h"], "{:.2f}")]
            + [_f(fit["h"] / float(d) / fit["t_inf"] if good else None, "{:+.1%}") for d in ds]
            + [_f(per_row.get(name), "{:g}") if fit else "-"]
        )
    lines += table(head, body) + [""]
    every = results.get("fits_every_dilation") or {}
    if every:
        lines += [
            "The same line fitted over every D: "
            + "; ".join(f"{name_of(n)} T_inf {f['t_inf']:.3f} s, h {f['h']:.2f} s" for n, f in every.items())
            + ".",
            "",
        ]
    waits = []
    for d, entry in per_d.items():
        for name, row in entry["rows"].items():
            waits.append(
                [
                    d,
                    name_of(name),
                    _f(row.get("runqueue_wait_share_max"), "{:.1%}"),
                    "**yes**" if row.get("waited_for_core") else "no",
                    _f(row.get("prediction_error"), "{:+.1%}"),
                    ", ".join(f"{x:.1f}" for x in entry.get("load_average") or []),
                ]
            )
    lines += [
        "Per run: the largest share of a step a rank's main thread waited for a core, and the load average "
        "(1/5/15 min) after the run.",
        "",
    ]
    lines += table(
        ["D", "schedule", "run-queue wait (worst rank)", "waited for a core", "simulator error", "load after"], waits
    ) + [""]
    fixed = {d: e["fixed_plan"] for d, e in per_d.items() if e.get("fixed_plan")}
    fixed = {d: ({"planned": f} if "same_configuration" in f else f) for d, f in fixed.items()}  # one plan, or each's
    if fixed:
        lines += [
            "Each planned column's plan at every D is the first D's, re-planned with its depth, schedule, "
            "micro-batch size and boundaries: "
            + "; ".join(
                f"{name_of(name)} at D = {d}: configuration {'same' if f['same_configuration'] else 'DIFFERS'}"
                f", re-computed layers {'same' if f['same_recomputation'] else 'differ'}"
                for d, plans in fixed.items()
                for name, f in plans.items()
            )
            + ".",
            "",
        ]
    best = results.get("smallest_dilation")
    lines += [
        f"Smallest D whose fitted step is within {results['within']:.0%} of T_inf for every schedule: "
        + (f"**{best:g}**." if best else "none of those measured."),
        "",
    ]
    host = results.get("host_cost")
    if host:
        lines += [
            f"Host cost fitted ({host.get('source')}): forward {host['forward']['fixed'] * 1e3:.2f} ms + "
            f"{host['forward']['per_layer'] * 1e3:.3f} ms/layer; backward {host['backward']['fixed'] * 1e3:.2f} ms + "
            f"{host['backward']['per_layer'] * 1e3:.3f} ms/layer + {host['recompute_per_layer'] * 1e3:.3f} ms per "
            f"re-computed layer; p2p {host['p2p']['fixed'] * 1e3:.2f} ms; "
            f"all-reduce {host['allreduce']['fixed'] * 1e3:.2f} "
            f"ms; step {host['step']['fixed'] * 1e3:.2f} ms + {host['step']['per_layer'] * 1e3:.3f} ms/layer "
            "(CPU seconds on this machine's core, before the scaling to a rank's share)."
        ]
    return "\n".join(lines) + "\n"
