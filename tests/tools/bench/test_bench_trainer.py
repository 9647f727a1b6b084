"""``shardfc bench --trainer``: the real step, the loader alone, the bare-step ceiling and the start-up, in one go."""

from __future__ import annotations

import json
import time

import pytest
import torch

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
    # the synthetic set's default source: a pool of its images, at most the set's 32
    assert r["source"]["kind"] == "pool" and r["source"]["pool_images"] == 32
    assert "source: a pool of 32 synthetic images rendered once (24.0 KiB of uint8" in text
    assert [(v["loader"], v["workers"]) for v in r["loaders"]] == [("renderer", 0)]  # the rate the pool stands in for
    assert "| synthetic renderer, 0 worker(s) | CPU |" in text
    assert r["first_evaluation_s"] is None and r["first_evaluation_targets"] == []  # --synthetic-val-pairs 0
    assert "| first evaluation (after the start-up, not in it) | none: the run has no evaluation target |" in text
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
    assert bench_cli.main(["--trainer", "--nproc", "2", *TINY]) == 2
    assert ("measures one process; got --nproc 2 (time a run of several with shardfc train --profile)"
            in capsys.readouterr().err)
    assert bench_cli.main(["--trainer", "--batch-sise", "4"]) == 2
    assert "unknown argument '--batch-sise'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--output-dir", "mine"], "--output-dir"), (["--resume", "none"], "--resume"),
    (["--ckpt-every", "5", "--keep-last", "2"], "--ckpt-every, --keep-last"), (["--no-save-on-signal"], "--save-on-signal"),
    (["--profile"], "--profile"), (["--no-progress"], "--progress"), (["--print-config"], "--print-config"),
])
def test_bench_trainer_refuses_the_train_flags_it_would_not_read(capsys, monkeypatch, flags, named):
    """Its output folder is a scratch one it removes, and it saves, resumes and prints nothing of a run:
    --output-dir mine was replaced without a word."""
    from shardfc.tools.bench import trainer

    monkeypatch.setattr(trainer, "bench_trainer", lambda *a, **k: pytest.fail("the bench ran"))
    assert bench_cli.main(["--trainer", *flags, *TINY]) == 2
    assert capsys.readouterr().err == (
        f"shardfc bench --trainer: error: shardfc bench --trainer saves, resumes and prints nothing of a run: {named} "
        "would not be read (it times steps in a scratch folder it removes)\n")


def test_bench_trainer_reads_the_flags_that_shape_the_step(monkeypatch):
    """--max-steps sets the schedule the timed steps follow; --log-every the loop's report points."""
    from shardfc.tools.bench import trainer

    class Reached(Exception):
        pass

    def bench(cfg, **kwargs):
        raise Reached(cfg)

    monkeypatch.setattr(trainer, "bench_trainer", bench)
    with pytest.raises(Reached) as reached:
        bench_cli.main(["--trainer", "--max-steps", "7", "--log-every", "3", *TINY])
    cfg = reached.value.args[0]
    assert (cfg.max_steps, cfg.log_every) == (7, 3)


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
    assert "source: the recordio loader (--loader torch, 2 loader worker(s))" in text
    assert "| data loader only (recordio) |" in text


def _spy_on_streams(monkeypatch):
    """Every stream the bench opens: (dataset type, its workers)."""
    import shardfc.train.loader.data as data_module

    streams, real = [], data_module.micro_batches
    monkeypatch.setattr(data_module, "micro_batches", lambda dataset, batches, state, cfg, *a, **k: streams.append(
        (type(dataset).__name__, cfg.num_workers)) or real(dataset, batches, state, cfg, *a, **k))
    return streams


def _slow_choose(self, key, candidates, *args, **kwargs):  # the head's impl="auto" timing, as on a GPU
    time.sleep(0.05)
    return "torch"


def test_bench_trainer_feeds_a_pool_through_the_runs_loader_workers_and_splits_the_startup(tmp_path, capsys,
                                                                                            monkeypatch):
    import shardfc.train.loop as loop
    from shardfc.head import impl_select

    streams = _spy_on_streams(monkeypatch)
    # What a GPU's first step does on top of a CPU's: a compilation and the head's impl="auto" timing.
    monkeypatch.setattr(impl_select.ImplSelector, "choose", _slow_choose)
    monkeypatch.setattr(impl_select, "_default", None)  # a fresh process selector, dropped after the test
    torch._dynamo.reset()
    first_step, real_step = [], loop.trainer_step

    def trainer_step(*args, **kwargs):
        if not first_step:
            first_step.append(torch.compile(lambda x: x.cos() - 1, backend="eager")(torch.ones(2)))
            impl_select.default_selector().choose("workload", {})
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "trainer_step", trainer_step)
    out = tmp_path / "bench.json"
    args = ["--trainer", "--steps", "2", "--warmup", "1", "--quiet", "--json", str(out), "--pool-size", "10",
            "--num-workers", "1", *TINY[:-6], "--synthetic-val-pairs", "20", "--threads", "1"]
    assert bench_cli.main(args) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    # the run's stream and its loader alone read the pool with the run's worker; the column, the renderer
    assert streams == [("SyntheticPool", 1), ("SyntheticIdentities", 1)]
    src = r["source"]
    assert (src["kind"], src["pool_images"], src["pool_bytes"], src["pool_render_workers"]) == ("pool", 10, 10 * 3 * 16 * 16, 1)
    assert src["pool_render_s"] > 0
    assert "source: a pool of 10 synthetic images rendered once (7.5 KiB of uint8 in memory" in text
    assert "read by 1 loader worker(s)" in text and "| data loader only (pool) |" in text
    assert [(v["loader"], v["workers"]) for v in r["loaders"]] == [("renderer", 1)] and r["loaders"][0]["images_per_s"] > 0
    # the start-up to the end of the first step, by what it went to: the parts add up to it
    split = r["startup_split"]
    assert list(split) == ["data", "build", "compile", "autotune", "rest of the first step"]
    assert split["compile"] > 0 and split["autotune"] >= 0.05  # within the first step
    first = dict(r["startup_phases"])["first step"]
    assert split["rest of the first step"] == pytest.approx(first - split["compile"] - split["autotune"])
    assert sum(split.values()) == pytest.approx(r["startup_s"]) and split["data"] > 0 and split["build"] > 0
    assert f"| start-up to the end of the first step | {r['startup_s']:.2f} s: data {split['data']:.2f} s, " in text
    assert f"rest of the first step {split['rest of the first step']:.2f} s |" in text
    # the first evaluation, apart from the start-up
    assert r["first_evaluation_targets"] == ["synthetic"] and r["first_evaluation_s"] > 0
    assert r["first_evaluation_compile_s"] == 0
    assert (f"| first evaluation (after the start-up, not in it) | {r['first_evaluation_s']:.2f} s (synthetic; "
            f"compile 0.00 s of it) |") in text


def test_bench_trainer_no_pool_feeds_the_renderer(tmp_path, capsys, monkeypatch):
    streams = _spy_on_streams(monkeypatch)
    out = tmp_path / "bench.json"
    assert bench_cli.main(["--trainer", "--steps", "1", "--warmup", "0", "--quiet", "--json", str(out), "--no-pool",
                           *TINY]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert streams == [("SyntheticIdentities", 0)] and r["source"] == {"kind": "renderer"} and r["loaders"] == []
    assert "source: the synthetic renderer, per sample in 0 loader worker(s) (--no-pool)" in text
    assert "| data loader only (renderer) |" in text


def test_bench_trainer_names_a_bad_pool_size(tmp_path, capsys):
    assert bench_cli.main(["--trainer", "--pool-size", "0", *TINY]) == 2
    assert ("--pool-size must be an int >= 1 (or --no-pool: the renderer feeds the loader), got 0"
            in capsys.readouterr().err)
    assert bench_cli.main(["--trainer", "--pool-size", "many", *TINY]) == 2
    assert "argument --pool-size: invalid int value: 'many'" in capsys.readouterr().err
    assert bench_cli.main(["--trainer", "--no-pool", "--pool-size", "8", *TINY]) == 2
    assert "--no-pool and --pool-size 8 exclude each other" in capsys.readouterr().err
    (tmp_path / "faces" / "a").mkdir(parents=True)
    assert bench_cli.main(["--trainer", "--pool-size", "8", "--dataset", "folder", "--data-root",
                           str(tmp_path / "faces"), "--image-size", "16", "16"]) == 2
    assert ("--pool-size 8 pre-renders the synthetic set, but --dataset folder is read by its own loader: "
            "leave --pool-size out") in capsys.readouterr().err
    big = ["--synthetic-identities", "100000", "--synthetic-images-per-identity", "100", "--image-size", "112", "112"]
    assert bench_cli.main(["--trainer", "--pool-size", "1000000", *big]) == 2
    assert ("--pool-size 1000000 at 112x112 is 35.0 GiB of uint8 images, over the bench's bound of 8 GiB"
            in capsys.readouterr().err)


def test_the_pool_feeds_the_trainer_the_renderers_labels_shapes_and_dtypes():
    """Through the trainer's data path (DataLoader worker, prefetcher, normalisation on the device):
    the same labels batch for batch, float32 images of the same shape, each within a pixel step of
    the render when the pool holds the whole set."""
    from shardfc.data import SyntheticIdentities, SyntheticPool
    from shardfc.parallel.context import DistContext
    from shardfc.train.config import TrainConfig
    from shardfc.train.loader.data import micro_batches, rank_batches
    from shardfc.train.state import RunState

    data = SyntheticIdentities(5, 4, (12, 8), seed=1)
    cfg, ctx = TrainConfig(batch_size=6, num_workers=1), DistContext()

    def batches(dataset, n=7):  # past an epoch's end (20 images: batches of 6, 6, 8)
        stream = micro_batches(dataset, rank_batches(cfg, dataset, 6, ctx), RunState(), cfg, ctx)
        try:
            return [next(stream)[:2] for _ in range(n)]
        finally:
            stream.close()

    rendered, whole, small = batches(data), batches(SyntheticPool(data, 20)), batches(SyntheticPool(data, 3))
    for (x, y), (xw, yw), (xs, ys) in zip(rendered, whole, small):
        assert torch.equal(y, yw) and torch.equal(y, ys) and y.dtype == yw.dtype == torch.int64
        assert x.shape == xw.shape == xs.shape and x.dtype == xw.dtype == xs.dtype == torch.float32
        assert (xw - x).abs().max() <= 0.5 / 127.5 + 1e-6 and xs.min() >= -1 and xs.max() <= 1


def test_startup_costs_time_compilation_and_the_heads_auto_timing_inside_the_with_only(monkeypatch):
    from torch._dynamo.callback import callback_handler

    from shardfc.head import impl_select
    from shardfc.tools.bench.trainer import StartupCosts, startup_split

    monkeypatch.setattr(impl_select.ImplSelector, "choose", _slow_choose)
    monkeypatch.setattr(impl_select, "_default", None)  # a fresh process selector, dropped after the test
    before = (len(callback_handler.start_callbacks), len(callback_handler.end_callbacks))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    with StartupCosts() as costs:
        compiled(torch.ones(3))
        assert impl_select.default_selector().choose("workload", {}) == "torch"
    assert costs.compile_s > 0 and costs.autotune_s >= 0.05
    seen = (costs.compile_s, costs.autotune_s)
    compiled(torch.ones(4, 2))  # a recompilation and a choice outside the with: not counted, nothing left behind
    impl_select.default_selector().choose("workload", {})
    assert (costs.compile_s, costs.autotune_s) == seen
    assert "choose" not in vars(impl_select.default_selector())
    assert (len(callback_handler.start_callbacks), len(callback_handler.end_callbacks)) == before
    phases = [("threads", 0.1), ("dataset", 0.2), ("sampler", 0.3), ("model, head and optimizers", 0.4),
              ("first batch", 0.5), ("first step", 1.0)]
    split = startup_split(phases, costs)
    assert split["data"] == pytest.approx(1.0) and split["build"] == pytest.approx(0.5)
    assert split["rest of the first step"] == pytest.approx(1.0 - sum(seen))
    assert sum(split.values()) == pytest.approx(2.5)
