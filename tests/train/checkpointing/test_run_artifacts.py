"""What a run leaves behind: metrics.csv after a resume, a finished run run again, strict JSON from
``shardfc eval --json``, and saved configs whose paths work from any folder."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from PIL import Image

from shardfc.cli import eval as cli_eval
from shardfc.train.config import absolute_paths
from shardfc.train.loop import train
from shardfc.train.observe.runlog import truncate_metrics

from ..tiny import tiny_config


def _market(root: Path) -> None:
    """A Market-1501 style split: <pid>_c<cam>s1_<frame>_01.jpg in query/ and bounding_box_test/."""
    for folder, cam in (("query", 1), ("bounding_box_test", 2)):
        (root / folder).mkdir(parents=True)
        for pid in (1, 2, 3):
            Image.new("RGB", (8, 16), (70 * pid, 30, 100)).save(root / folder / f"{pid:04d}_c{cam}s1_000{pid}00_01.jpg")


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A finished 4-step run trained from its own folder with relative paths: (workdir, config)."""
    work = tmp_path_factory.mktemp("work")
    _market(work / "market")
    before = os.getcwd()
    os.chdir(work)
    try:
        cfg = tiny_config(Path("run"), nproc=1, max_steps=4, log_every=1, ckpt_every=2, eval_every=0,
                          reid_root="market")
        assert train(cfg)["step"] == 4
    finally:
        os.chdir(before)
    return work, absolute_paths(cfg, work)


def _rows(run: Path):
    with open(run / "metrics.csv", newline="") as f:
        return [(int(r["step"]), r["name"]) for r in csv.DictReader(f)]


def test_saved_config_paths_are_absolute_so_eval_works_from_another_folder(run4, tmp_path, monkeypatch, capsys):
    work, _ = run4
    toml = (work / "run" / "config.toml").read_text()
    assert f'reid_root = "{work / "market"}"' in toml and f'output_dir = "{work / "run"}"' in toml
    monkeypatch.chdir(tmp_path)  # where "market" and "run" mean nothing
    assert cli_eval.main(["--checkpoint", str(work / "run")]) == 0, capsys.readouterr().err
    assert "reid: mAP" in capsys.readouterr().out


def test_resume_drops_the_metrics_written_after_its_checkpoint(run4, tmp_path):
    work, cfg = run4
    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # killed after logging step 4, before saving it
    assert train(dataclasses.replace(cfg, output_dir=str(run)))["step"] == 4
    rows = _rows(run)
    assert [s for s, n in rows if n == "train/loss"] == [1, 2, 3, 4]
    assert [s for s, n in rows] == sorted(s for s, n in rows), "the curves go back in time"
    assert len([1 for s, n in rows if n == "val/reid/mAP"]) == 1
    assert "dropped" in (run / "train.log").read_text()


def test_truncate_metrics_keeps_rows_up_to_the_step_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,name,value,elapsed_s\n1,a,0.5,1\n2,a,0.4,2\n3,a,0.3,3\n4,a,0.")
    assert truncate_metrics(path, 2) == 2
    assert path.read_text().splitlines() == ["step,name,value,elapsed_s", "1,a,0.5,1", "2,a,0.4,2"]
    assert truncate_metrics(path, 2) == 0


def test_a_finished_run_run_again_has_nothing_to_train_and_logs_nothing_twice(run4, tmp_path):
    work, cfg = run4
    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    before = (run / "metrics.csv").read_text()
    summary = train(dataclasses.replace(cfg, output_dir=str(run)))
    assert summary["step"] == 4 and summary["checkpoint"].endswith("step_00000004")
    assert "step_00000004 is at step 4; max 4 steps: nothing to train" in (run / "train.log").read_text()
    assert (run / "metrics.csv").read_text() == before
    assert "reid" in summary["metrics"]


def _png_bytes(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buf, format="PNG")
    return buf.getvalue()


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_eval_json_is_strict_json_with_undefined_values_explained(run4, tmp_path, capsys):
    work, _ = run4
    # 10 pairs: 5 negatives, too few to measure a FAR of 1e-3.
    colors = [(25 * i, 100, 255 - 25 * i) for i in range(10)]
    images = [b for i, c in enumerate(colors) for b in (_png_bytes(c), _png_bytes(c if i % 2 == 0 else colors[-1 - i]))]
    bin_path = tmp_path / "toy.bin"
    bin_path.write_bytes(pickle.dumps((images, [i % 2 == 0 for i in range(10)])))
    assert cli_eval.main(["--checkpoint", str(work / "run"), "--bin", str(bin_path), "--json"]) == 0
    report = _strict(capsys.readouterr().out)
    json.dumps(report, allow_nan=False)
    toy = report["metrics"]["toy"]
    assert 0.0 <= toy["accuracy"] <= 1.0 and toy["tar@far=1e-3"] is None
    assert "1000 negative pairs" in report["undefined"]["toy"]["tar@far=1e-3"]
    assert set(report["undefined"]["toy"]) == {k for k, v in toy.items() if v is None}


def _name_on_two_ranks(rank: int, world: int) -> list:
    """Rank 1 alone met broken.png (twice: in two reports); rank 0 must name it, once."""
    import logging

    import torch

    from shardfc.parallel.context import DistContext
    from shardfc.train.observe.reporting import _name_corrupt_images

    lines: list = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("shardfc.train").addHandler(handler)
    ctx = DistContext(None, rank, world, True, torch.device("cpu"))
    named: set = set()
    met = [("/data/id3/broken.png", "UnidentifiedImageError: cannot identify")] if rank == 1 else []
    for _ in range(2):
        _name_corrupt_images(met, named, ctx)
    return lines


def test_corrupt_images_met_on_another_rank_are_named_once_by_rank_0():
    from shardfc.parallel.launch import spawn

    rank0, rank1 = spawn(_name_on_two_ranks, 2)
    assert rank1 == []
    assert len(rank0) == 1 and "/data/id3/broken.png (UnidentifiedImageError" in rank0[0]
