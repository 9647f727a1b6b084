"""``shardfc bench --trainer``: the real step, the loader alone, the bare-step ceiling and the start-up, in one go."""

from __future__ import annotations

import json

import pytest

from shardfc.cli import bench as bench_cli

TINY = ["--synthetic-identities", "8", "--synthetic-images-per-identity", "4", "--image-size", "16", "16",
        "--embedding-dim", "8", "--batch-size", "4", "--synthetic-val-pairs", "0", "--threads", "1"]


def test_bench_trainer_prints_both_rates_their_ratio_the_loader_and_the_startup(tmp_path, capsys, monkeypatch):
    import shardfc.train.builder.factory as build

    built, factory = [], build.build_model  # what it times is built by the trainer's one builder
    monkeypatch.setattr(build, "build_model", lambda cfg, *a, **k: built.append(cfg) or factory(cfg, *a, **k))
    out = tmp_path / "bench.json"
    assert bench_cli.main(["--trainer", "--steps", "2", "--warmup", "1", "--quiet", "--json", str(out), *TINY]) == 0
    assert [cfg.embedding_dim for cfg in built] == [8]
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    for key in ("ceiling_images_per_s", "train_images_per_s", "loader_images_per_s", "startup_s"):
        assert r[key] > 0, key
    assert r["train_over_ceiling"] == r["train_images_per_s"] / r["ceiling_images_per_s"]
    assert r["loader_over_train"] == r["loader_images_per_s"] / r["train_images_per_s"]
    step_s = r["config"]["batch_size"] / r["train_images_per_s"]
    assert r["beyond_ceiling_and_loader_ms"] == pytest.approx(1e3 * step_s * r["beyond_ceiling_and_loader_share"])
    assert r["gpu_utilisation_percent"] is None and r["gpu_utilisation_why_none"] == "the CPU"
    assert [name for name, _ in r["startup_phases"]][-2:] == ["first batch", "first step"]
    assert r["config"]["batch_size"] == 4 and r["config"]["channels_last"] is False and r["config"]["amp"] == "fp32"
    assert "| GPU utilisation during the train steps | n/a |" in text
    assert f"| train / ceiling | {r['train_over_ceiling']:.2f} |" in text
    assert "ceiling: the bare step on device-resident random tensors" in text and "load average" in text
    # the loop's step split into phases, the ceiling's beside it
    phases, ceiling = r["step_phases"], r["ceiling_phases"]
    assert phases["steps"] == ceiling["steps"] == 2
    assert set(phases["ms_per_step"]) == {"stop agreement", "loader wait", "h2d", "forward", "head", "backward",
                                          "optimizer", "logging/metrics"}
    assert phases["total_ms"] == pytest.approx(sum(phases["ms_per_step"].values()))
    assert ceiling["outside_ms"] == 0 and ceiling["ms_per_step"]["forward"] > 0
    assert "| phase (mean of 2 steps) | ms / step | % of the step | ceiling ms / step |" in text
    assert f"| outside the data path and the bare step | {phases['outside_ms']:.3f} |" in text


def test_bench_trainer_names_a_bad_argument(capsys):
    assert bench_cli.main(["--trainer", "--steps", "0", *TINY]) == 2
    assert "--steps must be an int >= 1, got 0" in capsys.readouterr().err
    assert bench_cli.main(["--trainer", "--strategy", "pipeline", *TINY]) == 2
    assert "measures one process of strategy 'ddp'; got strategy='pipeline'" in capsys.readouterr().err
    assert bench_cli.main(["--trainer", "--batch-sise", "4"]) == 2
    assert "unknown argument '--batch-sise'" in capsys.readouterr().err


def test_bench_trainer_loader_column_rates_the_torch_loader_and_dali(tmp_path, capsys, dali):
    import numpy as np
    from PIL import Image

    from shardfc.cli import data as data_cli

    rng = np.random.default_rng(0)
    for k in range(24):
        path = tmp_path / "faces" / f"id{k % 4}" / f"{k}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
    assert data_cli.main(["pack", str(tmp_path / "faces"), str(tmp_path / "rec")]) == 0
    out = tmp_path / "bench.json"
    args = ["--trainer", "--steps", "2", "--warmup", "1", "--quiet", "--json", str(out), "--dataset", "recordio",
            "--data-root", str(tmp_path / "rec"), "--num-workers", "2", *TINY[4:]]
    assert bench_cli.main(args) == 0
    text = capsys.readouterr().out
    loaders = json.loads(out.read_text())["loaders"]
    assert [(v["loader"], v["workers"], v["decode"]) for v in loaders] == [
        ("torch", 0, "CPU"), ("torch", 2, "CPU"), ("dali", 2, "CPU")]
    assert all(v["images_per_s"] > 0 for v in loaders)
    assert "| dali, 2 thread(s) | CPU |" in text and "| torch, 0 worker(s) | CPU |" in text
