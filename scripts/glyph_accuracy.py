"""The head's accuracy table on glyph identities (docs/accuracy.md): one `shardfc train --preset glyphs`
run per row and seed, read back from its metrics.csv, as JSON, a markdown table and a plot.

    shardfc data glyphs data/glyphs
    python scripts/glyph_accuracy.py --data-root data/glyphs --seeds 0,1 --epochs 6 \\
        --out docs/bench/glyph_accuracy.json --plot docs/bench/glyph_accuracy.png

Rows (each the preset plus its flags): the margins (softmax, CosFace, ArcFace, sub-centre ArcFace
K = 3), Partial FC at r = 0.3 / 0.1 / 0.05, bf16 centres, and bf16 centres without the head's
momentum (2·D bytes a class at rest). Each run is a subprocess on 2 spawned CPU processes; a run
folder that already holds a finished run is read, not run again (--rerun to force).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from typing import Dict, List

ROWS: Dict[str, List[str]] = {
    "ArcFace (m = 0.5)": [],
    "softmax": ["--margin", "softmax"],
    "CosFace (m = 0.35)": ["--margin", "cosface", "--m", "0.35"],
    "sub-centre ArcFace, K = 3": ["--subcenters", "3"],
    "Partial FC r = 0.3": ["--sample-rate", "0.3"],
    "Partial FC r = 0.1": ["--sample-rate", "0.1"],
    "Partial FC r = 0.05": ["--sample-rate", "0.05"],
    # the update before the exact catch-up: an idle row waits, unchanged, for its next sample
    "Partial FC r = 0.3, lazy": ["--sample-rate", "0.3", "--head-idle-rows", "lazy"],
    "Partial FC r = 0.1, lazy": ["--sample-rate", "0.1", "--head-idle-rows", "lazy"],
    "Partial FC r = 0.05, lazy": ["--sample-rate", "0.05", "--head-idle-rows", "lazy"],
    "bf16 centres": ["--head-dtype", "bfloat16"],
    "bf16 centres, no head momentum (2·D bytes a class)": ["--head-dtype", "bfloat16", "--head-momentum", "0"],
}
#: docs/accuracy.md's main table (the default): every row but the lazy update's
TABLE_ROWS = [name for name in ROWS if not name.endswith(", lazy")]
SETS = ("glyphs_unseen", "glyphs_hard", "glyphs_faces")


def last_metrics(run: str) -> Dict[str, float]:
    """The last evaluation's values (``val/<set>/<name>``) and the last training loss."""
    values: Dict[str, float] = {}
    with open(os.path.join(run, "metrics.csv"), newline="") as f:
        for row in csv.DictReader(f):
            if row["name"].startswith("val/") or row["name"] == "train/loss":
                try:
                    values[row["name"]] = float(row["value"])
                except ValueError:  # 'n/a': a FAR the set's negatives cannot measure
                    values.pop(row["name"], None)
    return values


def train_seconds(run: str) -> float:
    """The run's own wall time, from its train.log ("done: step N in X s")."""
    import re

    with open(os.path.join(run, "train.log"), encoding="utf-8") as f:
        found = re.findall(r"done: step \d+ in ([0-9.]+) s", f.read())
    return float(found[-1]) if found else float("nan")


def loss_curve(run: str) -> List[List[float]]:
    with open(os.path.join(run, "metrics.csv"), newline="") as f:
        return [[int(r["step"]), float(r["value"])] for r in csv.DictReader(f) if r["name"] == "train/loss"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-root", required=True)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--rows", default=";".join(TABLE_ROWS),
                   help="row names separated by ';' (default: docs/accuracy.md's table, every row but the lazy ones)")
    p.add_argument("--runs", default="shardfc_runs/glyph_accuracy", help="folder of the run folders")
    p.add_argument("--out", default="glyph_accuracy.json")
    p.add_argument("--plot", default=None)
    p.add_argument("--seeds-for", action="append", default=[], metavar="ROW=SEEDS",
                   help="other seeds for one row, e.g. 'ArcFace (m = 0.5)=0,1,2' (repeatable)")
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--train-args", default="",
                   help="more `shardfc train` flags for every run, e.g. '--batch-size 32' (split on spaces)")
    args = p.parse_args(argv)
    extra = args.train_args.split()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = [r.strip() for r in args.rows.split(";") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; rows are {list(ROWS)}")
    row_seeds = {name: seeds for name in rows}
    for item in args.seeds_for:
        name, _, values = item.rpartition("=")
        if name not in ROWS:
            p.error(f"--seeds-for: unknown row {name!r}")
        row_seeds[name] = [int(v) for v in values.split(",")]
    results = []
    for name in rows:
        for seed in row_seeds[name]:
            slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
            run = os.path.join(args.runs, f"{slug}_seed{seed}")
            cmd = [sys.executable, "-m", "shardfc", "train", "--preset", "glyphs", "--data-root", args.data_root,
                   "--seed", str(seed), "--epochs", str(args.epochs), "--no-progress", "--resume", "none",
                   "--output-dir", run, *extra, *ROWS[name]]
            done = os.path.exists(os.path.join(run, "metrics.csv")) and any(
                k.startswith("val/") for k in last_metrics(run)) and not args.rerun
            if not done:
                shutil.rmtree(run, ignore_errors=True)  # an unfinished run starts over
                print(f"[glyph_accuracy] {name}, seed {seed}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
                done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if done.returncode:
                    sys.exit(f"[glyph_accuracy] {name}, seed {seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            m = last_metrics(run)
            results.append(dict(row=name, seed=seed, flags=extra + ROWS[name], run=run, train_s=train_seconds(run),
                                loss=m.get("train/loss"), curve=loss_curve(run),
                                **{f"{s}/{k}": m.get(f"val/{s}/{k}") for s in SETS
                                   for k in ("accuracy", "accuracy_std", "tar@far=1e-3")}))
            print(f"[glyph_accuracy] {name}, seed {seed}: " + ", ".join(
                f"{s} {100 * results[-1][f'{s}/accuracy']:.2f}%" for s in SETS), file=sys.stderr, flush=True)
    table = summarise(results)
    with open(args.out, "w") as f:
        json.dump(dict(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                       python=platform.python_version(), epochs=args.epochs, seeds=row_seeds, data_root=args.data_root,
                       runs=results, table=table), f, indent=1)
        f.write("\n")
    print(markdown(table))
    if args.plot:
        plot(results, table, args.plot)
    return 0


def summarise(results) -> List[dict]:
    out = []
    for name in dict.fromkeys(r["row"] for r in results):
        runs = [r for r in results if r["row"] == name]
        row = dict(row=name, flags=" ".join(runs[0]["flags"]), seeds=len(runs))
        for s in SETS:
            for k in ("accuracy", "tar@far=1e-3"):
                vals = [100 * r[f"{s}/{k}"] for r in runs if r[f"{s}/{k}"] is not None]
                row[f"{s}/{k}"] = (statistics.mean(vals), (max(vals) - min(vals)) / 2 if len(vals) > 1 else None)
        out.append(row)
    return out


def markdown(table) -> str:
    def cell(v):
        mean, half = v
        return f"{mean:.2f}" + (f" ± {half:.2f}" if half is not None else "")

    lines = ["| head | unseen: acc. | unseen: TAR@1e-3 | hard: acc. | hard: TAR@1e-3 | unseen faces: acc. | "
             "unseen faces: TAR@1e-3 | flags |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in table:
        cells = [cell(r[f"{s}/{k}"]) for s in SETS for k in ("accuracy", "tar@far=1e-3")]
        lines.append(f"| {r['row']} | " + " | ".join(cells) + f" | `{r['flags'] or '(the preset)'}` |")
    return "\n".join(lines)


def plot(results, table, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [r["row"] for r in table]
    for i, s in enumerate(("glyphs_hard", "glyphs_unseen", "glyphs_faces")):
        means = [r[f"{s}/accuracy"][0] for r in table]
        errs = [r[f"{s}/accuracy"][1] or 0 for r in table]
        ax.barh([y + 0.27 * (i - 1) for y in range(len(names))], means, height=0.27, xerr=errs,
                label=s.replace("glyphs_", ""))
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("verification accuracy (%), mean ± half-range over seeds")
    lo = min(r["glyphs_hard/accuracy"][0] for r in table)
    ax.set_xlim(max(50, lo - 5), 100)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    for r in results:
        if r["seed"] == results[0]["seed"]:
            steps, losses = zip(*r["curve"]) if r["curve"] else ((), ())
            bx.plot(steps, losses, label=r["row"], lw=1)
    bx.set_yscale("log")
    bx.set_xlabel("step")
    bx.set_ylabel("training loss (seed %d)" % results[0]["seed"])
    bx.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
