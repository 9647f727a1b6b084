"""fp32 vs bf16 class centres under Partial FC, on the synthetic default of ``shardfc train``.

Trains the same run (same seed, data and step budget) with the head in fp32 (the reference) and in
bf16 with a row-sparse gradient, updates rounded to nearest and stochastically; prints each run's
final verification accuracy, bytes per class at rest and wall time, and draws the loss curves side
by side. Usage (about 3 x 40 s on an idle 2-core CPU)::

    PYTHONPATH=src python scripts/compare_head_precision.py --out /tmp/precision --max-steps 600
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import time
from pathlib import Path

RUNS = {
    "fp32": dict(head_dtype="float32"),
    "bf16 nearest": dict(head_dtype="bfloat16", head_rounding="nearest", sparse_grad=True),
    "bf16 stochastic": dict(head_dtype="bfloat16", head_rounding="stochastic", sparse_grad=True),
}


def _read(csv_path: Path):
    losses, accuracy = [], None
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            if row["name"] == "train/loss":
                losses.append((int(row["step"]), float(row["value"])))
            elif row["name"].endswith("/accuracy"):
                accuracy = float(row["value"])
    return losses, accuracy


def main() -> None:
    from shardfc.cli import train as train_cli
    from shardfc.train.config import TrainConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--sample-rate", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="seed of the run (model, data, sampling, rounding)")
    args = p.parse_args()
    results = {}
    for name, options in RUNS.items():
        out = args.out / name.replace(" ", "_")
        cfg = dataclasses.replace(TrainConfig(), output_dir=str(out), max_steps=args.max_steps, resume="none",
                                  sample_rate=args.sample_rate, progress=False, ckpt_every=0, seed=args.seed,
                                  **options)
        started = time.time()
        train_cli.run(cfg)
        losses, accuracy = _read(out / "metrics.csv")
        width = 2 if cfg.head_dtype != "float32" else 4
        per_class = cfg.embedding_dim * width * (2 if cfg.sparse_grad else 3)  # weight + momentum (+ kept .grad)
        results[name] = dict(losses=losses, accuracy=accuracy, seconds=time.time() - started, per_class=per_class)
    print("| head | verification accuracy | bytes/class at rest | wall time |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {100 * r['accuracy']:.2f}% | {r['per_class']} | {r['seconds']:.0f} s |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot([s for s, _ in r["losses"]], [v for _, v in r["losses"]], label=f"{name} ({100 * r['accuracy']:.1f}%)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"Partial FC r={args.sample_rate}: fp32 vs bf16 class centres")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "loss_curves.png", dpi=100)
    print(f"wrote {args.out / 'loss_curves.png'}")


if __name__ == "__main__":
    main()
