"""``shardfc bench`` smoke run: 2 gloo ranks, tiny sizes, 2 timed steps, every variant that exists.

One CLI run for the whole module (it spawns the process group once); the tests read its outputs.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from shardfc.tools.bench import FIELDS, VARIANTS, run_bench
from shardfc.tools.bench.cli import main
from shardfc.tools.bench.report import markdown_table

W, B, D, C = 2, 9, 16, 1000  # B % W != 0: unequal local batches
AVAILABLE = list(VARIANTS)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    stdout, stderr = io.StringIO(), io.StringIO()
    argv = [
        "--world-size", str(W), "--batch", str(B), "--dim", str(D), "--classes", str(C),
        "--variants", ",".join(AVAILABLE), "--steps", "2", "--warmup", "1",
        "--chunk-size", "64", "--sample-rate", "0.25",
        "--json", str(json_path), "--plot", str(png_path),
    ]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    return dict(code=code, json=json_path, png=png_path, stdout=stdout.getvalue(), stderr=stderr.getvalue())


def test_cli_succeeds_and_prints_table(run):
    assert run["code"] == 0, run["stderr"]
    table = run["stdout"]
    assert "| variant | step time (s) |" in table
    assert "memory measure:" in table
    for v in AVAILABLE:
        assert f"| {v} |" in table
    assert "[bench]" in run["stderr"]  # progress on stderr


def test_json_has_exactly_the_documented_fields(run):
    results = json.loads(run["json"].read_text())
    assert [r["variant"] for r in results] == AVAILABLE
    for r in results:
        assert tuple(r) == FIELDS
        assert r["step_time_s"] > 0
        assert len(r["peak_bytes_per_rank"]) == W and all(isinstance(p, int) and p >= 0 for p in r["peak_bytes_per_rank"])
        assert r["balance"] is None or r["balance"] >= 1.0
        assert isinstance(r["comm_bytes_per_rank"], int) and r["comm_bytes_per_rank"] > 0
        assert r["floor_ratio"] > 0


def test_plot_is_a_png(run):
    data = run["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_sharded_and_chunked_move_the_same_bytes(run):
    results = {r["variant"]: r for r in json.loads(run["json"].read_text())}
    assert results["sharded"]["comm_bytes_per_rank"] == results["chunked"]["comm_bytes_per_rank"]


@pytest.mark.parametrize("variant", ["naive", "replicated", "partial"])
def test_baseline_and_partial_variants_ran(run, variant):
    results = {r["variant"]: r for r in json.loads(run["json"].read_text())}
    assert variant in results


def test_markdown_table_of_results():
    results = [dict(variant="sharded", step_time_s=0.5, peak_bytes_per_rank=[2**20, 2**21], balance=2.0, comm_bytes_per_rank=10, floor_ratio=1.5)]
    text = markdown_table(results)
    assert "| sharded | 0.5000 | 1.0 / 2.0 | 2.000 | 10 | 1.50 |" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--world-size", "0"], "world_size"),
        (["--variants", "sharded,bogus"], "bogus"),
        (["--variants", "sharded,sharded"], "at most once"),
        (["--sample-rate", "1.5"], "sample_rate"),
        (["--sample-rate", "0"], "sample_rate"),
        (["--chunk-size", "0"], "chunk_size"),
        (["--steps", "0"], "steps"),
        (["--warmup", "-1"], "warmup"),
        (["--dtype", "float8"], "dtype"),
        (["--classes", "1"], "classes"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(extra, message):
    argv = ["--world-size", "2", "--batch", "4", "--dim", "4", "--classes", "10", "--steps", "1"]
    for i in range(0, len(extra), 2):
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i : i + 2]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 2
    assert message in err.getvalue()


def test_missing_required_argument_exits_2():
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["--world-size", "2"]) == 2


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(batch=0), "batch"),
        (dict(dim=-1), "dim"),
        (dict(variants=[]), "variants"),
        (dict(sample_rate=2.0), "sample_rate"),
        (dict(chunk_size=-3), "chunk_size"),
        (dict(chunk_size="big"), "chunk_size"),
        (dict(margin="nope"), "nope"),
    ],
)
def test_run_bench_rejects_bad_arguments_before_spawning(kwargs, name):
    args = dict(world_size=2, batch=4, dim=4, classes=10, variants="sharded", steps=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        run_bench(**args)
