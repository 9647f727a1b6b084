"""One ``shardfc bench`` run (2 gloo ranks, every variant, tiny sizes) for the whole of tests/tools:
the bench tests read its outputs, the plan tests compare their predictions with its peaks.
Spawning the process group is most of the cost, so it happens once."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from shardfc.cli.bench import main
from shardfc.tools.bench import VARIANTS

#: the shared run: W ranks, global batch B (W divides it: every rank holds B/W rows, as the plan
#: assumes), width D, C classes, chunk size and Partial FC rate
BENCH = dict(W=2, B=64, D=32, C=4000, CHUNK=256, RATE=0.25)


def _bench(tmp_path_factory, *extra: str, variants=VARIANTS):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    stdout, stderr = io.StringIO(), io.StringIO()
    b = BENCH
    argv = [
        "--world-size", str(b["W"]), "--batch", str(b["B"]), "--dim", str(b["D"]), "--classes", str(b["C"]),
        "--variants", ",".join(variants), "--steps", "1", "--warmup", "1",
        "--chunk-size", str(b["CHUNK"]), "--sample-rate", str(b["RATE"]),
        "--json", str(json_path), "--plot", str(png_path), *extra,
    ]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    results = {r["variant"]: r for r in json.loads(json_path.read_text())} if json_path.exists() else {}
    return dict(code=code, json=json_path, png=png_path, stdout=stdout.getvalue(), stderr=stderr.getvalue(),
                results=results, sizes=dict(BENCH))


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory):
    return _bench(tmp_path_factory)


@pytest.fixture(scope="session")
def bench_run_bf16_sparse(tmp_path_factory):
    """The sharded variants again with bf16 weights and state, Partial FC with its row-sparse gradient."""
    return _bench(tmp_path_factory, "--dtype", "bfloat16", "--sparse-grad", variants=("sharded", "chunked", "partial"))
