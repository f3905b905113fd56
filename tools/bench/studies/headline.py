"""``python -m tools.bench headline``: README's headline from the scaling study's published results.

Reads docs/bench/scaling/{vgg16,gnmt16}/results.json (``python -m tools.bench scaling``), writes one
table per model at the most nodes run (every column's time dilation D, against stock 1F1B and DP, scaling
from one node, memory per device, ME against DP, whether a rank waited for a core), each followed by the figures
block tests/docs/test_doc_figures.py checks it with, between README's ``<!-- HEADLINE START -->`` and
``<!-- HEADLINE END -->`` markers, and draws docs/images/headline.png: ME against DP and the scaling
from one node per column, beside the paper's figures. Nothing is typed by hand: rerun it after the
study.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tools.bench import REPO
from tools.bench.studies.scaling_plan_report import name_of

START, END = "<!-- HEADLINE START -->", "<!-- HEADLINE END -->"
COLUMNS = ("1f1b", "dp", "gpipe", "hippie-1f1b", "planned", "planned-throughput")
PAPER_ME, PAPER_SCALING = 4.18, 0.90  # Hippie (seed 000): up to 4.18x DP's ME; > 90% scaling on 16 GPUs


def _range(row: dict, key: str, fmt: str) -> tuple[str, list[str]]:
    """'1.71x (1.60-1.80)' and its figure expressions (median, min, max), or the median alone when the
    rounds agree or there is one. Pure."""
    v, lo, hi = row.get(key), row.get(f"{key}_min"), row.get(f"{key}_max")
    if v is None:
        return "-", []
    if lo is None or hi is None or fmt.format(lo) == fmt.format(hi):
        return fmt.format(v), [f"{{{{path}}.{key}}}"]
    return (
        f"{fmt.format(v)} ({fmt.format(lo).rstrip('x')}-{fmt.format(hi).rstrip('x')})",
        [f"{{{{path}}.{key}}}", f"{{{{path}}.{key}_min}}", f"{{{{path}}.{key}_max}}"],
    )


def link_equivalent(cfg: dict) -> str:
    """The real link the shaped one stands for: its rate / the emulated model's scale (10mbit x 1e-3:
    10 Gbit/s). Pure."""
    from tools.bench.cluster import parse_rate

    rate = next((t for t in str(cfg.get("link", "")).split() if t[:1].isdigit()), None)
    if rate is None or not cfg.get("emulate_scale"):
        return str(cfg.get("link"))
    return f"{parse_rate(rate) * 8 / cfg['emulate_scale'] / 1e9:g} Gbit/s"


def model_table(results: dict, source: str, model: str) -> list[str]:
    """The markdown table of ``model``'s most nodes, then its figures block citing ``source``. Pure."""
    by_nodes = results["summary"]["by_nodes"]
    n = max(by_nodes, key=int)
    rows = by_nodes[n]
    cfg = results["config"]
    d_job = cfg.get("dilation", 1)
    ds = {rows[s].get("dilation", d_job) for s in COLUMNS if s in rows}
    what = f"time dilation D = {d_job:g}" if ds <= {d_job} else "each column at its time dilation D"
    lines = [
        f"**{model}, {n} nodes x {cfg['stages']} V100s (emulated, {what}), {link_equivalent(cfg)} between nodes**",
        "",
        "| schedule | kind | D | vs stock 1F1B | scaling 1 -> " + n + " nodes | memory/device (GB) | ME vs DP | "
        "waited for a core |",
        "|---|---|---|---|---|---|---|---|",
    ]
    block = [f"<!-- figures {source}"]
    for s in COLUMNS:
        row = rows.get(s)
        if row is None:
            continue
        path = f"summary.by_nodes.{n}.{s}"
        label = name_of(s)
        wait = row.get("runqueue_wait_share_max")
        d = row.get("dilation")  # a row's own D (rows before per-row D: the job's)
        d_cell, d_expr = (f"{d:g}", f"{{{path}.dilation}}") if d else (f"{d_job:g}", "{config.dilation}")
        block.append(f"{label} | D | {d_expr}")
        if row.get("waited_for_core"):  # it measured the machine's contention: no figure
            lines.append(f"| {label} | emulated | {d_cell} | not a figure | - | - | - | **yes** ({wait:.1%}) |")
            block.append(f"{label} | waited | {{{path}.runqueue_wait_share_max}}*100")
            continue
        vs, e_vs = _range(row, "vs_1f1b", "{:.2f}x")
        sc, e_sc = _range(row, "scaling", "{:.2f}")
        mem = f"{row['memory_bytes'] / 1e9:.2f}" if row.get("memory_bytes") else "-"
        me = f"{row['me_vs_dp']:.2f}x" if row.get("me_vs_dp") else "-"
        waited = (
            "-" if wait is None else (f"**yes** ({wait:.1%})" if row.get("waited_for_core") else f"no ({wait:.1%})")
        )
        lines.append(f"| {label} | emulated | {d_cell} | {vs} | {sc} | {mem} | {me} | {waited} |")
        for column, exprs in (("vs stock 1F1B", e_vs), ("scaling", e_sc)):
            if exprs:
                block.append(f"{label} | {column} | " + " ".join(e.replace("{path}", path) for e in exprs))
        if mem != "-":
            block.append(f"{label} | memory | {{{path}.memory_bytes}}/1e9")
        if me != "-":
            block.append(f"{label} | ME vs DP | {{{path}.me_vs_dp}}")
        if wait is not None:
            block.append(f"{label} | waited | {{{path}.runqueue_wait_share_max}}*100")
    return lines + [""] + block + ["-->"]


def picture(models: dict, path: Path) -> None:
    """ME against DP and the scaling from one node per column, per model, beside the paper's figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / max(1, len(models))
    for k, (model, results) in enumerate(models.items()):
        by_nodes = results["summary"]["by_nodes"]
        rows = by_nodes[max(by_nodes, key=int)]
        names = [s for s in COLUMNS if s in rows]
        for ax, key in zip(axes, ("me_vs_dp", "scaling")):
            xs = [COLUMNS.index(s) + (k - (len(models) - 1) / 2) * width for s in names]
            bars = ax.bar(xs, [rows[s].get(key) or 0 for s in names], width, label=model)
            for bar, s in zip(bars, names):  # a rank waited for a core: drawn, but marked as no figure
                if rows[s].get("waited_for_core"):
                    bar.set_hatch("//")
                    bar.set_alpha(0.35)
    for ax, ref, title in (
        (axes[0], PAPER_ME, "memory efficiency vs DP (4 nodes)"),
        (axes[1], PAPER_SCALING, "scaling efficiency 1 -> 4 nodes"),
    ):
        ax.axhline(ref, color="k", ls="--", lw=1, label=f"Hippie paper: {ref:g}")
        ax.set_xticks(range(len(COLUMNS)), [name_of(s).replace(" (", "\n(") for s in COLUMNS], fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(
        "emulated cluster (PipeDream's V100 profiles, time-dilated on a 2-core CPU): no GPU run; "
        "hatched: a rank waited for a core (not a figure)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def splice(text: str, section: str) -> str:
    """``text`` with what lies between START and END replaced by ``section``. Pure."""
    if START not in text or END not in text:
        raise SystemExit(f"README has no {START} ... {END} markers: add them where the headline goes")
    head, rest = text.split(START, 1)
    return head + START + "\n" + section.rstrip() + "\n" + END + rest.split(END, 1)[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench headline", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--results",
        action="append",
        default=None,
        metavar="MODEL=FILE",
        help="a scaling study's results.json per model (default: VGG-16 and GNMT-16's published ones)",
    )
    p.add_argument(
        "--readme",
        action="append",
        default=None,
        metavar="FILE",
        help="a markdown file with the markers to write into (default: README.md and docs/results.md)",
    )
    p.add_argument("--picture", default=str(REPO / "docs" / "images" / "headline.png"))
    a = p.parse_args(argv)
    given = a.results or [
        f"VGG-16={REPO / 'docs/bench/scaling/vgg16/results.json'}",
        f"GNMT-16={REPO / 'docs/bench/scaling/gnmt16/results.json'}",
    ]
    models, section = {}, []
    for item in given:
        model, _, file = item.partition("=")
        path = Path(file).resolve()
        if not path.is_file():
            continue
        models[model] = json.loads(path.read_text())
        source = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
        section += model_table(models[model], source, model) + [""]
    if not models:
        raise SystemExit("no results.json found: run python -m tools.bench scaling first")
    pic = Path(a.picture).resolve()
    picture(models, pic)
    for doc in a.readme or [str(REPO / "README.md"), str(REPO / "docs" / "results.md")]:
        doc = Path(doc).resolve()
        image = f"![ME against DP and scaling per column]({os.path.relpath(pic, doc.parent)})"
        doc.write_text(splice(doc.read_text(), "\n".join(section + [image])))
    print("\n".join(section))
    return 0
