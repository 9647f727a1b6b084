"""The run's picture: metrics.csv drawn into curves.png, with the metric names the trainer writes."""

import csv
import math

import numpy as np

from shardfc.evaluation.verification import verification_metrics
from shardfc.train.observe.runlog import RunLog, format_metrics, plot_metrics, read_series


def test_plot_metrics_draws_the_scalars_the_trainer_writes(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    lines = ["step,name,value,elapsed_s"]
    for step in range(0, 200, 10):
        lines += [
            f"{step},train/loss,{10 - step / 40},1.0",
            f"{step},train/lr,0.1,1.0",
            f"{step},train/images_per_s,500,1.0",
            f"{step},train/epoch,{step // 50},1.0",  # bookkeeping: no panel
        ]
    lines += [
        "100,val/synthetic/accuracy,0.8,2.0",
        "199,val/synthetic/accuracy,0.9,3.0",
        "199,val/lfw/tar@far=0.001,0.7,3.0",
        "199,val/lfw/achieved_far@far=0.001,0.001,3.0",  # bookkeeping: no panel
        "199,val/market/mAP,0.5,3.0",
        "200,train/lo",  # the torn last line of an interrupted run
    ]
    csv_path.write_text("\n".join(lines) + "\n")
    png = tmp_path / "curves.png"
    drawn = plot_metrics(csv_path, png)
    assert drawn[0] == "train/loss"
    assert set(drawn) == {
        "train/loss", "train/lr", "train/images_per_s",
        "val/synthetic/accuracy", "val/lfw/tar@far=0.001", "val/market/mAP",
    }
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_metrics_with_nothing_to_draw(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("step,name,value,elapsed_s\n")
    assert plot_metrics(csv_path, tmp_path / "curves.png") == []
    assert not (tmp_path / "curves.png").exists()


def test_a_far_too_small_for_the_pairs_is_na_in_csv_log_and_curves(tmp_path):
    # 1200 pairs, 600 negatives: FAR 1e-3 needs 1000 of them, FAR 1e-2 only 100.
    rng = np.random.default_rng(0)
    same = np.arange(1200) % 2 == 0
    a = rng.normal(size=(1200, 8))
    b = np.where(same[:, None], a + 0.5 * rng.normal(size=(1200, 8)), rng.normal(size=(1200, 8)))
    m = verification_metrics(a, b, same, far_targets=(1e-2, 1e-3))
    assert math.isfinite(m["tar@far=1e-2"]) and math.isnan(m["tar@far=1e-3"])

    line = format_metrics(m)
    assert f"tar@far=1e-2 {100 * m['tar@far=1e-2']:.2f}%" in line
    assert "tar@far=1e-3 n/a (FAR 1e-3 needs at least 1000 negative pairs, this set has 600)" in line
    assert "nan" not in line.lower()

    with RunLog(tmp_path, is_main=True, progress=False) as log:
        log.start_at(0)
        log.scalars(5, {"train/loss": 3.0})
        log.scalars(10, {f"val/lfw/{k}": v for k, v in m.items()})
        log.scalars(20, {"train/loss": 2.0, "val/lfw/tar@far=1e-2": 0.5, "val/lfw/tar@far=1e-3": float("nan")})
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = {(int(r["step"]), r["name"]): r["value"] for r in csv.DictReader(f)}
    assert rows[(10, "val/lfw/tar@far=1e-3")] == "n/a" and rows[(10, "val/lfw/exact_tar@far=1e-3")] == "n/a"
    assert rows[(20, "val/lfw/tar@far=1e-3")] == "n/a"
    assert float(rows[(10, "val/lfw/tar@far=1e-2")]) == float(f"{m['tar@far=1e-2']:.6g}")
    assert not any(v.lower() == "nan" for v in rows.values())
    # curves.png: no point for n/a, and no panel for a metric that never had a number
    series = read_series(tmp_path / "metrics.csv")
    assert series["val/lfw/tar@far=1e-2"] == [(10, float(f"{m['tar@far=1e-2']:.6g}")), (20, 0.5)]
    assert "val/lfw/tar@far=1e-3" not in series and "val/lfw/exact_tar@far=1e-3" not in series
    drawn = plot_metrics(tmp_path / "metrics.csv", tmp_path / "again.png")
    assert "val/lfw/tar@far=1e-2" in drawn and not any(n.endswith("@far=1e-3") for n in drawn)
    assert (tmp_path / "curves.png").is_file()
