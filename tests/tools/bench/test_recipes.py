"""``shardfc bench --recipes`` / ``--split-sweep``: real ``shardfc train`` runs, measured from their profiles."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import statistics
from pathlib import Path

import pytest
import torch

from shardfc.cli.bench import main as bench_main
from shardfc.parallel.split_bench import FIELDS as SPLIT_FIELDS
from shardfc.tools.bench import recipes
from shardfc.tools.bench.recipes import RECIPES, ROW_FIELDS, Recipe, Workload, measure, run_recipe

TINY = ["--backbone", "tiny", "--image-size", "16", "16", "--batch-size", "8", "--classes", "24",
        "--embedding-dim", "16", "--nproc", "2", "--threads", "1"]


def _bench(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = bench_main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One ddp-spawn run (2 ranks, 2 + 1 steps) beside the rows that cannot run here."""
    tmp = tmp_path_factory.mktemp("recipes")
    argv = ["--recipes", "--only", "ddp-spawn,dp,pipeline", "--precisions", "fp32", "--steps", "2", "--warmup", "1",
            *TINY, "--work-dir", str(tmp / "work"), "--json", str(tmp / "r.json"), "--plot", str(tmp / "r.png"), "--quiet"]
    code, out, err = _bench(argv)
    assert code == 0, err
    return tmp, out, json.loads((tmp / "r.json").read_text())


def test_recipes_json_has_the_documented_fields(smoke):
    tmp, _, doc = smoke
    assert set(doc) == {"workload", "devices_note", "load_average", "recipes", "split_sweep"}
    assert doc["split_sweep"] is None and set(doc["load_average"]) == {"before", "after"}
    assert doc["workload"]["backbone"] == "tiny" and doc["workload"]["steps"] == 2
    rows = {r["recipe"]: r for r in doc["recipes"]}
    assert list(rows) == ["ddp-spawn", "dp", "pipeline"]
    for r in doc["recipes"]:
        assert list(r) == list(ROW_FIELDS)
    assert (tmp / "r.png").read_bytes().startswith(b"\x89PNG")


def test_recipes_ddp_row_is_read_from_the_trainer_profiles(smoke):
    _, _, doc = smoke
    row = doc["recipes"][0]
    assert (row["status"], row["reason"], row["processes"], row["launcher"], row["precision"]) == ("ok", None, 2, "spawn", "fp32")
    profiles = [json.loads(p.read_text()) for p in sorted((Path(row["log"]).with_suffix("") / "profile").glob("rank*.json"))]
    assert len(profiles) == 2 and all(len(p["step_s"]) == 3 for p in profiles)
    # the median over the 2 timed steps (after 1 warm-up) of the slowest process's time
    assert row["step_time_s"] == pytest.approx(statistics.median(max(p["step_s"][i] for p in profiles) for i in (1, 2)))
    assert row["samples_per_s"] == pytest.approx(16 / row["step_time_s"])
    assert row["peak_rss_bytes_per_process"] == [p["peak_rss_bytes"] for p in profiles]
    assert row["comm_bytes_per_step"] >= sum(p.numel() * 4 for p in _tiny().parameters())  # DDP's gradients at least
    assert row["comm_counted"] is True and row["cuda_peak_bytes_per_process"] is None


def _tiny():
    from shardfc.models import build_backbone

    return build_backbone("tiny", 16, input_size=(16, 16))


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="dp runs on >= 2 CUDA devices")
def test_recipes_that_cannot_run_here_keep_a_row_with_the_reason(smoke):
    _, out, doc = smoke
    dp, pipeline = doc["recipes"][1], doc["recipes"][2]
    assert dp["status"] == "unavailable" and dp["reason"].startswith("cannot run here:") and "CUDA" in dp["reason"]
    # the pipeline runs here: 2 stages of one replica, read back from both stages' profiles
    assert (pipeline["status"], pipeline["reason"], pipeline["processes"]) == ("ok", None, 2)
    assert pipeline["step_time_s"] > 0 and len(pipeline["peak_rss_bytes_per_process"]) == 2
    # the stage-to-stage traffic (point to point) is counted where it is sent, per process: stage 0
    # sends its 8 rows' activations at the cut, stage 1 their gradients (the same bytes)
    boundary = 8 * _tiny().body(torch.zeros(1, 3, 16, 16)).numel() * 4
    assert pipeline["comm_counted"] is True
    assert pipeline["stage_bytes_per_step_per_process"] == [boundary, boundary]
    assert all(c >= boundary for c in pipeline["comm_bytes_per_step_per_process"])
    assert f"(stage to stage: {boundary:,} / {boundary:,})" in out
    assert doc["recipes"][0]["stage_bytes_per_step_per_process"] is None  # ddp has no stages
    assert dp["reason"] in out and "devices: none but the CPU" in out


def test_a_recipe_this_build_refuses_is_named_with_the_cli_error(tmp_path):
    fake = Recipe("warp", "spawn", "warp", lambda n: ["--strategy", "warp", "--nproc", str(n)], lambda n: n, "no such thing")
    row = run_recipe(fake, "fp32", Workload(backbone="tiny", image_size=(16, 16)), tmp_path, timeout_s=60)
    assert row["status"] == "unavailable"
    assert row["reason"].startswith("not available in this build: shardfc train: strategy must be one of")
    assert not (tmp_path / "warp-fp32.log").exists()  # nothing was started
    assert row["command"].endswith("--amp none")  # fp32 said outright: the trainer's default is 'auto'


def test_run_recipes_runs_each_recipe_at_each_precision_in_order_and_says_how_each_went(monkeypatch, tmp_path, capsys):
    calls = []

    def run_recipe(recipe, precision, work, work_dir, timeout_s):
        calls.append((recipe.name, precision, work, work_dir, timeout_s))
        ok = precision == "fp32"
        return {"status": "ok" if ok else "failed", "step_time_s": 0.25 if ok else None, "reason": "boom"}

    monkeypatch.setattr(recipes, "run_recipe", run_recipe)
    work = Workload(backbone="tiny", image_size=(16, 16), batch_size=8, classes=24, embedding_dim=16, steps=2, warmup=1)
    rows = recipes.run_recipes(["ddp-spawn", "pipeline"], ["fp32", "amp"], work, str(tmp_path), 12.5)
    assert calls == [(name, precision, work, tmp_path, 12.5) for name in ("ddp-spawn", "pipeline")
                     for precision in ("fp32", "amp")]
    assert [r["status"] for r in rows] == ["ok", "failed"] * 2
    assert capsys.readouterr().err == "".join(
        f"[bench --recipes] {name} fp32 ...\n[bench --recipes]   0.250 s/step\n"
        f"[bench --recipes] {name} amp ...\n[bench --recipes]   failed: boom\n" for name in ("ddp-spawn", "pipeline"))
    calls.clear()
    recipes.run_recipes(["dp"], ["amp"], work, tmp_path, progress=False)
    assert calls == [("dp", "amp", work, tmp_path, 600.0)]  # the default timeout
    assert capsys.readouterr().err == ""


def test_a_run_past_its_timeout_is_killed_and_reported(tmp_path):
    work = Workload(backbone="tiny", image_size=(16, 16), batch_size=8, classes=24, embedding_dim=16, steps=2, warmup=1)
    row = run_recipe(RECIPES["ddp-spawn"], "fp32", work, tmp_path, timeout_s=0.5)
    assert row["status"] == "failed" and row["reason"].startswith("timed out after 0.5 s")
    assert row["step_time_s"] is None


def _profile(folder: Path, rank: int, step_s, comm, rss, samples=(10, 10, 10, 10)):
    (folder / "profile").mkdir(parents=True, exist_ok=True)
    doc = {"step_s": list(step_s), "samples": list(samples), "comm_bytes": list(comm), "peak_rss_bytes": rss,
           "cuda_peak_bytes": None, "backbone_traffic_counted": True}
    (folder / "profile" / f"rank{rank}.json").write_text(json.dumps(doc))


def test_measure_takes_the_slowest_process_per_step_after_warmup(tmp_path):
    _profile(tmp_path, 0, [9.0, 1.0, 4.0, 2.0], [0, 100, 100, 130], 7)
    _profile(tmp_path, 1, [9.0, 3.0, 1.0, 2.5], [0, 200, 210, 220], 8)
    m = measure(tmp_path, 2, warmup=1)
    # slowest per timed step: 3.0, 4.0, 2.5 -> median 3.0
    assert m["step_time_s"] == 3.0
    assert m["step_time_std_s"] == pytest.approx(torch.tensor([3.0, 4.0, 2.5]).std(unbiased=False).item())
    assert m["samples_per_s"] == pytest.approx(10 / 3.0)
    assert m["comm_bytes_per_step"] == 210 and m["peak_rss_bytes_per_process"] == [7, 8]
    assert m["processes"] == 2 and measure(tmp_path, None, warmup=1) == m  # None: as many as were written
    with pytest.raises(ValueError, match="expected 3 profile file"):
        measure(tmp_path, 3, warmup=1)
    with pytest.raises(ValueError, match="expected some profile file"):
        measure(tmp_path / "nothing", None, warmup=1)
    with pytest.raises(ValueError, match="need > 4"):
        measure(tmp_path, 2, warmup=4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipes", "--only", "ddp,nccl"], "recipes: unknown 'ddp', 'nccl'; choose from ddp-torchrun"),
        (["--recipes", "--precisions", "fp64"], "precisions must be a comma-separated subset of fp32,amp"),
        (["--recipes", "--nproc", "0"], "nproc must be a positive integer, got 0"),
        (["--recipes", "--backbone", "vgg"], "unknown backbone 'vgg'"),
        (["--recipes", "--backbone", "iresnet18", "--image-size", "32", "32"], "image_size=[32, 32] but backbone='iresnet18'"),
        (["--recipes", "--timeout", "0"], "timeout must be a finite number > 0 of seconds, got 0.0"),
        (["--recipes", "--timeout", "nan"], "timeout must be a finite number > 0 of seconds, got nan"),
        (["--recipes", "--timeout", "inf"], "timeout must be a finite number > 0 of seconds, got inf"),
        (["--split-sweep", "--split-sizes", "2,x"], "--split-sizes must be comma-separated integers"),
        (["--split-sweep", "--threads", "0"], "threads must be a positive integer, got 0"),
        # the workload both comparisons train: a ZeroDivisionError, a silently replaced --split-batch, a
        # misnamed --nproc and tracebacks from inside the sweep's model before these were checked up front
        (["--recipes", "--classes", "0"], "classes must be a positive integer, got 0"),
        (["--split-sweep", "--classes", "0"], "classes must be a positive integer, got 0"),
        (["--split-sweep", "--split-batch", "0"], "--split-batch must be a positive integer, got 0"),
        (["--split-sweep", "--nproc", "0"], "nproc must be a positive integer, got 0"),
        (["--split-sweep", "--batch-size", "0"], "batch_size must be a positive integer, got 0"),
        (["--recipes", "--embedding-dim", "0"], "embedding_dim must be a positive integer, got 0"),
        (["--split-sweep", "--embedding-dim", "0"], "embedding_dim must be a positive integer, got 0"),
        (["--split-sweep", "--steps", "0"], "steps must be a positive integer, got 0"),
        (["--recipes", "--warmup", "-1"], "warmup must be an int >= 0, got -1"),
        (["--split-sweep", "--backbone", "tiny", "--image-size", "0", "0"], "image_size must be empty or two ints"),
        (["--recipes", "--backbone", "tiny", "--image-size", "3", "8"],
         "image_size must be a (height, width) pair of ints >= 4, got (3, 8)"),
        (["--split-sweep", "--backbone", "vgg"], "unknown backbone 'vgg'"),
        # an option of the comparison not asked for was dropped silently (no plot written, no recipe chosen)
        (["--split-sweep", "--plot", "r.png"], "--plot applies to --recipes, which was not asked for"),
        (["--split-sweep", "--only", "dp"], "--only applies to --recipes, which was not asked for"),
        (["--split-sweep", "--precisions", "fp32"], "--precisions applies to --recipes, which was not asked for"),
        (["--recipes", "--split-plot", "s.png"], "--split-plot applies to --split-sweep, which was not asked for"),
        (["--recipes", "--split-sizes", "2"], "--split-sizes applies to --split-sweep, which was not asked for"),
        (["--recipes", "--split-batch", "8"], "--split-batch applies to --split-sweep, which was not asked for"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_anything_runs(tmp_path, argv, message):
    code, _, err = _bench(argv + ["--work-dir", str(tmp_path), "--quiet"])
    assert code == 2 and message in err
    assert not any(tmp_path.iterdir())


def test_split_sweep_json_table_and_plot(tmp_path):
    argv = ["--split-sweep", *TINY, "--split-sizes", "2,4", "--steps", "2", "--warmup", "0",
            "--json", str(tmp_path / "s.json"), "--split-plot", str(tmp_path / "s.png"), "--quiet"]
    code, out, err = _bench(argv)
    assert code == 0, err
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["recipes"] is None
    rows = doc["split_sweep"]
    assert [(r["config"], r["split_size"]) for r in rows] == [("single", None), ("split", None), ("pipelined", 2), ("pipelined", 4)]
    assert all(list(r) == list(SPLIT_FIELDS) and r["batch"] == 16 and len(r["times_s"]) == 2 for r in rows)
    assert "| pipelined | 4 |" in out and "CPU device twice in one process" in out
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")


def test_every_recipe_builds_a_command_for_its_launcher(tmp_path):
    work = Workload(nproc=3)
    cmds = {name: recipes.command(r, work, tmp_path) for name, r in RECIPES.items()}
    assert cmds["ddp-torchrun"][1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=3" in cmds["ddp-torchrun"]
    assert cmds["horovod"][1:4] == ["-np", "3", "--gloo"]
    assert cmds["ddp-spawn"][cmds["ddp-spawn"].index("--nproc") + 1] == "3"
    assert all("--profile" in c and c[c.index("--output-dir") + 1] == str(tmp_path) for c in cmds.values())


def test_each_comparisons_defaults_reach_it(monkeypatch, tmp_path):
    """Without --precisions / --split-sizes (now None until resolved): both precisions, sizes 2, 4, 8, 16."""
    import shardfc.parallel.split_bench as split_bench
    from shardfc.cli import bench_recipes as cli

    seen = {}
    monkeypatch.setattr(cli, "run_recipes", lambda names, precisions, *a: seen.update(precisions=precisions) or [])
    monkeypatch.setattr(cli.report, "recipes_table", lambda rows, meta: "")
    monkeypatch.setattr(split_bench, "time_split_sweep", lambda backbone, batch, size, devices, sizes, steps, **kw:
                        seen.update(sizes=sizes, batch=batch) or [])
    monkeypatch.setattr(cli.report, "split_table", lambda split: "")
    assert cli.main(["--recipes", "--split-sweep", "--quiet", "--work-dir", str(tmp_path), "--device", "cpu",
                     "--nproc", "2", "--batch-size", "3"]) == 0
    assert seen == dict(precisions=recipes.parse_precisions("fp32,amp"), sizes=[2, 4, 8, 16], batch=6)


def test_the_sweep_trains_the_workload_with_its_own_batch_and_says_so(monkeypatch, tmp_path, capsys):
    """Every setting of the workload and of the sweep reaches time_split_sweep; --split-batch replaces
    batch_size x nproc (0 is refused, not read as 'unset'); the progress line names what runs."""
    import shardfc.parallel.split_bench as split_bench
    from shardfc.cli import bench_recipes as cli

    calls = []
    monkeypatch.setattr(split_bench, "time_split_sweep", lambda *args, **kw: calls.append((args, kw)) or [])
    monkeypatch.setattr(cli.report, "split_table", lambda split: "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--split-sweep", "--backbone", "tiny", "--image-size", "16", "8", "--embedding-dim", "12", "--steps", "3",
            "--warmup", "2", "--seed", "5", "--nproc", "2", "--batch-size", "3", "--split-sizes", "1,3",
            "--work-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    assert cli.main(argv + ["--split-batch", "7", "--quiet"]) == 0
    assert cli.main(argv + ["--split-batch", "1", "--quiet"]) == 0  # the smallest count (the sweep itself
    # refuses 1 row in training mode, where BatchNorm needs two)
    kw = dict(warmup=2, embedding_dim=12, seed=5)
    assert calls == [(("tiny", batch, (16, 8), ["cpu", "cpu"], [1, 3], 3), kw) for batch in (6, 7, 1)]
    err = capsys.readouterr().err
    assert err.count("[bench --split-sweep]") == 1
    assert "[bench --split-sweep] tiny batch 6 on ['cpu', 'cpu'], split sizes [1, 3] ...\n" in err


def test_neither_comparison_asked_for_is_an_error(tmp_path, capsys):
    from shardfc.cli import bench_recipes as cli

    assert cli.main(["--work-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "shardfc bench: error: give --recipes and/or --split-sweep\n"


@pytest.mark.parametrize("count, device, expected", [
    (1, "auto", ["cuda:0", "cuda:0"]), (2, "auto", ["cuda:0", "cuda:1"]), (3, "cuda", ["cuda:0", "cuda:1"]),
    (2, "cpu", ["cpu", "cpu"]), (0, "auto", ["cpu", "cpu"]),
])
def test_the_sweep_splits_over_two_gpus_where_there_are_two(monkeypatch, tmp_path, count, device, expected):
    import shardfc.parallel.split_bench as split_bench
    from shardfc.cli import bench_recipes as cli

    devices = []
    monkeypatch.setattr(split_bench, "time_split_sweep", lambda *args, **kw: devices.append(args[3]) or [])
    monkeypatch.setattr(cli.report, "split_table", lambda split: "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a GPU")
    assert cli.main(["--split-sweep", "--backbone", "tiny", "--image-size", "16", "16", "--device", device, "--quiet",
                     "--work-dir", str(tmp_path)]) == 0
    assert devices == [expected]


def test_the_recipes_get_the_workload_the_timeout_and_whether_to_say_how_they_go(monkeypatch, tmp_path):
    from shardfc.cli import bench_recipes as cli

    calls = []
    monkeypatch.setattr(cli, "run_recipes", lambda *args: calls.append(args) or [])
    monkeypatch.setattr(cli.report, "recipes_table", lambda rows, meta: "")
    argv = ["--recipes", "--only", "dp", "--precisions", "amp", *TINY, "--timeout", "42", "--work-dir", str(tmp_path)]
    assert cli.main(argv) == 0 and cli.main(argv + ["--quiet"]) == 0
    work = Workload(nproc=2, backbone="tiny", image_size=(16, 16), batch_size=8, classes=24, embedding_dim=16, threads=1)
    assert calls == [(["dp"], ["amp"], work, tmp_path, 42.0, progress) for progress in (True, False)]
    argv[argv.index("42")] = "0.5"  # any time above 0, under a second too
    assert cli.main(argv) == 0 and calls[-1][4] == 0.5


@pytest.mark.parametrize("cpus, nproc, given, threads", [
    (8, 2, None, 4), (3, 2, None, 1), (1, 4, None, 1), (None, 2, None, 1), (None, 1, None, 1), (8, 1, None, 8),
    (8, 2, 3, 3),  # --threads given: as given
])
def test_the_report_files_the_meta_and_the_default_threads(monkeypatch, tmp_path, capsys, cpus, nproc, given, threads):
    """What each output flag writes and says, the run's meta (the workload, where it ran, the load
    average before and after rounded to 2 places) and the threads a recipe gets by default: the
    machine's cores over the processes, at least one."""
    import shardfc.parallel.split_bench as split_bench
    from shardfc.cli import bench_recipes as cli

    written = []
    rows, split = [{"recipe": "dp"}], [{"devices": ["cpu", "cpu"]}]
    monkeypatch.setattr(cli, "run_recipes", lambda names, precisions, work, *a: written.append(("work", work)) or rows)
    monkeypatch.setattr(split_bench, "time_split_sweep", lambda *a, **kw: split)
    monkeypatch.setattr(cli.report, "recipes_table", lambda r, meta: f"table of {r} on {meta['devices_note'][:12]}")
    monkeypatch.setattr(cli.report, "split_table", lambda s: f"sweep of {s}")
    monkeypatch.setattr(cli.report, "write_json", lambda *a: written.append(("json", *a)))
    monkeypatch.setattr(cli.report, "plot_recipes", lambda *a: written.append(("plot", *a)))
    monkeypatch.setattr(cli.report, "plot_split_sweep", lambda *a: written.append(("split_plot", *a)))
    loads = iter([(1.234, 2.345, 3.456), (4.567, 5.678, 6.789)])
    monkeypatch.setattr(cli.os, "getloadavg", lambda: next(loads))
    monkeypatch.setattr(cli.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    paths = {flag: str(tmp_path / name) for flag, name in
             (("--json", "r.json"), ("--plot", "r.png"), ("--split-plot", "s.png"))}
    argv = ["--recipes", "--split-sweep", "--quiet", "--only", "dp", "--precisions", "fp32", "--device", "cpu",
            "--nproc", str(nproc), "--work-dir", str(tmp_path), *[x for kv in paths.items() for x in kv]]
    assert cli.main(argv + ([] if given is None else ["--threads", str(given)])) == 0
    (_, work), (_, json_path, meta, json_rows, json_split), plot, split_plot = written
    assert (work.threads, work.nproc, work.device) == (threads, nproc, "cpu")
    assert (json_path, json_rows, json_split) == (paths["--json"], rows, split)
    assert meta["load_average"] == {"before": [1.23, 2.35, 3.46], "after": [4.57, 5.68, 6.79]}
    assert meta["workload"] == dataclasses.asdict(work) and meta["devices_note"] == cli.devices_note("cpu", nproc)
    assert plot == ("plot", rows, paths["--plot"], meta)
    assert split_plot == ("split_plot", split, paths["--split-plot"], "CPU: both stages on one device, nothing overlaps")
    out, err = capsys.readouterr()
    assert out == (f"table of {rows} on devices: non\n\nsplit sweep: one device vs split over two vs pipelined "
                   f"(forward + backward per step)\n\nsweep of {split}\n")
    assert err == "".join(f"wrote {paths[f]}\n" for f in ("--json", "--plot", "--split-plot"))


def test_the_sweep_alone_prints_where_it_ran_and_a_gpu_plot_has_no_cpu_subtitle(monkeypatch, tmp_path, capsys):
    import shardfc.parallel.split_bench as split_bench
    from shardfc.cli import bench_recipes as cli

    plotted = []
    monkeypatch.setattr(split_bench, "time_split_sweep", lambda *a, **kw: [{"devices": ["cuda:0", "cuda:1"]}])
    monkeypatch.setattr(cli.report, "split_table", lambda s: "the sweep")
    monkeypatch.setattr(cli.report, "plot_split_sweep", lambda *a: plotted.append(a[2]))
    monkeypatch.setattr(cli, "devices_note", lambda device, nproc: f"where: {device}, {nproc}")
    assert cli.main(["--split-sweep", "--quiet", "--backbone", "tiny", "--image-size", "16", "16", "--device", "cpu",
                     "--nproc", "3", "--work-dir", str(tmp_path), "--split-plot", str(tmp_path / "s.png")]) == 0
    assert plotted == [""]  # the CPU's subtitle only where both stages are the CPU
    assert capsys.readouterr().out.startswith("where: cpu, 3\n\nsplit sweep: ")


def test_help_and_a_bad_flag_exit_as_argparse_says(capsys):
    from shardfc.cli import bench_recipes as cli

    assert cli.main(["--help"]) == 0 and "--recipes" in capsys.readouterr().out
    assert cli.main(["--recipes", "--no-such-flag"]) == 2 and "unrecognized arguments" in capsys.readouterr().err
