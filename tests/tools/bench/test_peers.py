"""``shardfc bench --peers`` on the CPU at tiny shapes: the table, JSON and plot, rows that cannot run
and their reasons, argument checks, and every row's loss against the dense reference."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from shardfc import cli as shardfc_cli
from shardfc.cli import bench_peers as peers_cli
from shardfc.head import margins as M
from shardfc.head.module import ShardedMarginHead
from shardfc.head.reference import reference_loss
from shardfc.tools.bench import peers
from shardfc.tools.bench.peers import NEEDS_CUDA, ROW_FIELDS, SYSTEMS, run_peers

#: the tiny workload every test here runs
TINY = dict(batch=32, dim=16, classes=300, steps=2, warmup=1)
#: torch's own fused linear + cross-entropy rows, where this torch has the op (2.13 does, 2.11 not)
LCE_ROWS = (("softmax-torch-lce", "softmax-torch-lce-chunked")
            if hasattr(torch.nn.functional, "linear_cross_entropy") else ())
TINY_ARGV = ["--batch", "32", "--dim", "16", "--classes", "300", "--steps", "2", "--warmup", "1", "--device", "cpu"]


def _run(argv, entry=peers_cli.main):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = entry(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One run of every system through ``shardfc bench --peers`` (bf16 autocast, the default)."""
    folder = tmp_path_factory.mktemp("peers")
    json_path, png_path = folder / "peers.json", folder / "peers.png"
    code, out, err = _run(["bench", "--peers", *TINY_ARGV, "--json", str(json_path), "--plot", str(png_path)],
                          entry=shardfc_cli.main)
    return dict(code=code, stdout=out, stderr=err, json=json_path, png=png_path)


def _rows(doc):
    return {r["system"]: r for r in doc["rows"]}


# --------------------------------------------------------------------------- outputs
def test_table_has_every_system_the_device_and_versions(cli_run):
    assert cli_run["code"] == 0, cli_run["stderr"]
    table = cli_run["stdout"]
    assert f"device: cpu; torch {torch.__version__}" in table and "triton " in table
    assert "| system | step ms | × floor | extra memory | loss (rel. err.) | note |" in table
    for system in SYSTEMS.values():
        assert f"| {system.label} |" in table
    assert f"unavailable: {NEEDS_CUDA}" in table  # the triton rows on the CPU
    assert "[peers]" in cli_run["stderr"]  # progress on stderr


def test_json_holds_one_row_per_system_with_the_documented_fields(cli_run):
    doc = json.loads(cli_run["json"].read_text())
    assert set(doc) == {"workload", "environment", "memory_measure", "loss_rtol", "references", "rows"}
    assert doc["environment"]["device"] == "cpu" and doc["environment"]["torch"] == torch.__version__
    assert "triton" in doc["environment"]
    assert doc["workload"]["batch"] == 32 and doc["workload"]["dtype"] == "bfloat16"
    # the documented defaults of the Partial FC and chunked rows (given neither flag)
    assert (doc["workload"]["sample_rate"], doc["workload"]["chunk_size"]) == (0.1, "auto")
    assert doc["memory_measure"] == "cpu_live_tensors"
    assert [r["system"] for r in doc["rows"]] == list(SYSTEMS)
    rows = _rows(doc)
    floor = rows["floor"]["step_time_ms"]
    for r in doc["rows"]:
        assert tuple(r) == ROW_FIELDS
        if r["status"] == "ok":
            assert len(r["step_times_ms"]) == 2 and r["step_time_ms"] > 0
            assert isinstance(r["extra_memory_bytes"], int) and r["extra_memory_bytes"] >= 0
            assert r["ratio_to_floor"] == pytest.approx(r["step_time_ms"] / floor)
            assert r["reason"] is None
        else:
            assert r["status"] == "unavailable" and r["reason"] and r["step_time_ms"] is None
    for name in ("shardfc-torch", "shardfc-auto", "shardfc-chunked", "shardfc-partial", "dense", "softmax-shardfc-torch",
                 "softmax-dense") + LCE_ROWS:
        assert rows[name]["status"] == "ok", rows[name]
    if not LCE_ROWS:  # torch before F.linear_cross_entropy (2.11, the GPU machine's): said, not dropped
        for name in ("softmax-torch-lce", "softmax-torch-lce-chunked"):
            assert rows[name]["reason"] == f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    assert rows["dense-compile"]["reason"].startswith("skipped on the CPU")
    assert rows["shardfc-auto"]["note"].startswith("auto chose impl=torch")  # what auto picks on the CPU
    # the step's [B, C] logits are what the dense head adds; the chunked head adds less than the dense one
    assert rows["dense"]["extra_memory_bytes"] >= 32 * 300 * 4


def test_plot_is_a_png(cli_run):
    data = cli_run["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --------------------------------------------------------------------------- losses
def test_bf16_losses_agree_with_the_reference(cli_run):
    doc = json.loads(cli_run["json"].read_text())
    rows = _rows(doc)
    assert doc["references"]["margin"]["how"] == doc["references"]["softmax"]["how"] == "reference in float64"
    for name in ("shardfc-torch", "shardfc-auto", "shardfc-chunked", "dense", "softmax-shardfc-torch", "softmax-dense") + LCE_ROWS:
        r = rows[name]
        assert r["loss_agrees"] is True and r["loss_rel_err"] <= doc["loss_rtol"], r
        assert r["reference_loss"] == doc["references"][r["group"]]["loss"]
    assert rows["dense"]["loss_rel_err"] > 1e-6  # the compute really ran in bf16 (fp32 is within 1e-7 here)
    assert rows["shardfc-partial"]["loss"] is not None and rows["shardfc-partial"]["loss_agrees"] is None
    assert "Partial FC samples the negatives" in rows["shardfc-partial"]["note"]


def test_fp32_losses_match_the_float64_reference_closely():
    doc = run_peers(**TINY, dtype="float32", device="cpu", progress=False,
                    systems=",".join(("shardfc-torch", "shardfc-auto", "shardfc-chunked", "dense", "softmax-shardfc-torch",
                                      "softmax-dense") + LCE_ROWS))
    for r in doc["rows"]:
        assert r["status"] == "ok" and r["loss_agrees"] is True and r["loss_rel_err"] < 1e-5, r


@pytest.mark.parametrize("name", ["arcface", "cosface", "combined", "normsoftmax"])
def test_plain_dense_loss_is_the_reference_with_its_gradients(name):
    """The dense peer, written plainly, is shardfc.reference_loss — ArcFace's θ > π − m branch included."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 50, (12,), generator=g)
    x = torch.randn(12, 8, generator=g, dtype=torch.float64)
    x[:4] = -w[y[:4]]  # θ = π at the target: past π − m
    margin = M.build_margin(name)
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ours = peers.dense_margin_loss(xa, wa, y, margin)
    ref = reference_loss(xb, wb, y, margin)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-8, atol=1e-10)


def test_a_wrong_loss_is_caught_and_fails_the_run(monkeypatch):
    """The cross-check has teeth: a dense peer with another margin disagrees, and the CLI exits 1."""
    monkeypatch.setattr(peers, "dense_margin_loss",
                        lambda x, w, y, margin: peers.dense_softmax_loss(x, w, y))  # margin forgotten
    code, out, err = _run([*TINY_ARGV, "--systems", "dense", "--quiet"])
    assert code == 1
    assert "**disagrees**" in out and "dense: loss" in err and "relative error" in err


def test_heads_start_from_the_shared_centres_without_drawing_their_own(monkeypatch):
    """At a million classes a head's own CPU draw costs seconds: the bench hands it the shared centres."""
    from shardfc.head import module

    def no_draw(*args):
        raise AssertionError("init_rows drew centres on the CPU")

    monkeypatch.setattr(module, "init_rows", no_draw)
    doc = run_peers(**TINY, device="cpu", progress=False, systems="shardfc-torch,shardfc-partial")
    assert [r["status"] for r in doc["rows"]] == ["ok", "ok"], doc["rows"]
    assert module.init_rows is no_draw  # put back


# --------------------------------------------------------------------------- rows that cannot run
def test_missing_peers_keep_their_rows_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    doc = run_peers(**TINY, device="cpu", progress=False, systems="softmax-cce,softmax-liger")
    rows = _rows(doc)
    assert rows["softmax-cce"]["status"] == rows["softmax-liger"]["status"] == "unavailable"
    assert rows["softmax-cce"]["reason"].startswith("not installed: cut-cross-entropy")
    assert rows["softmax-liger"]["reason"].startswith("not installed: liger-kernel")
    assert peers.failures(doc) == []  # a peer that is not installed is no failure


def test_an_installed_peer_on_the_cpu_needs_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", types.SimpleNamespace(linear_cross_entropy=None))
    doc = run_peers(**TINY, device="cpu", progress=False, systems="softmax-cce")
    assert doc["rows"][0]["status"] == "unavailable" and doc["rows"][0]["reason"] == "needs CUDA"


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_gpu_impl_rows_on_the_cpu_need_cuda(monkeypatch, impl):
    """The head's own answer: its impl='<name>' raises 'cannot run' on CPU tensors without the interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    head = ShardedMarginHead(16, 300, impl=impl)
    with pytest.raises(ValueError, match=f"impl='{impl}' cannot run: .*not a CUDA device"):
        head(torch.randn(4, 16), torch.randint(0, 300, (4,)))
    doc = run_peers(**TINY, device="cpu", progress=False, systems=f"shardfc-{impl},softmax-shardfc-{impl}")
    assert [(r["status"], r["reason"]) for r in doc["rows"]] == [("unavailable", NEEDS_CUDA)] * 2, doc["rows"]
    assert peers.failures(doc) == []


def test_an_impl_that_cannot_run_for_another_reason_keeps_the_heads_words(monkeypatch):
    """Any impl, any reason: the head's "impl='<name>' cannot run: <why>" is the row's reason; other errors fail."""
    from shardfc.head import module

    def refuse(impl, *args, **kwargs):
        if impl == "torch":
            raise ValueError("something else broke")
        raise ValueError(f"impl={impl!r} cannot run: compute dtype torch.float64 is not one of fp32, bf16, fp16")

    monkeypatch.setattr(module, "resolve_impl", refuse)
    doc = run_peers(**TINY, device="cpu", progress=False, systems="shardfc-gemm,softmax-shardfc-triton,shardfc-torch")
    rows = _rows(doc)
    assert rows["shardfc-gemm"]["status"] == rows["softmax-shardfc-triton"]["status"] == "unavailable"
    assert rows["shardfc-gemm"]["reason"] == "impl='gemm' cannot run: compute dtype torch.float64 is not one of fp32, bf16, fp16"
    assert rows["softmax-shardfc-triton"]["reason"].startswith("impl='triton' cannot run: compute dtype")
    # any other ValueError of the head is the row's failure, not a reason to skip it
    assert (rows["shardfc-torch"]["status"], rows["shardfc-torch"]["reason"]) == ("failed", "ValueError: something else broke")
    assert [line.split(":")[0] for line in peers.failures(doc)] == ["shardfc-torch"]


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_gpu_impl_rows_under_the_interpreter(tmp_path, impl):
    """TRITON_INTERPRET=1 runs the GPU impls of the head on CPU tensors."""
    pytest.importorskip("triton")
    out = tmp_path / "t.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(peers.__file__).parents[3])}
    proc = subprocess.run(  # the interpreter is slow: the smallest workload, one timed step
        [sys.executable, "-m", "shardfc", "bench", "--peers", "--batch", "8", "--dim", "8", "--classes", "64",
         "--steps", "1", "--warmup", "0", "--device", "cpu", "--dtype", "float32", "--quiet",
         "--systems", f"shardfc-{impl}", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert all(r["status"] == "ok" and r["loss_agrees"] and f"ran impl={impl}" in r["note"] for r in rows), rows


def test_a_system_that_fails_keeps_its_row_with_its_error(monkeypatch):
    def boom(wl, setup):
        raise RuntimeError("kernel exploded")

    def oom(wl, setup):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setitem(SYSTEMS, "dense", peers.System("plain torch dense, eager", "margin", boom))
    monkeypatch.setitem(SYSTEMS, "softmax-dense", peers.System("softmax: plain torch dense, eager", "softmax", oom))
    code, out, err = _run([*TINY_ARGV, "--systems", "floor,dense,softmax-dense", "--quiet"])
    assert code == 1
    assert "| plain torch dense, eager | — | — | — | — | failed: RuntimeError: kernel exploded |" in out
    assert "failed: out of memory: CUDA out of memory. Tried to allocate 4.00 GiB" in out
    assert "| matmul floor: x·Wᵀ, dZ·W, dZᵀ·x |" in out and "dense: RuntimeError: kernel exploded" in err


# --------------------------------------------------------------------------- torch's linear_cross_entropy
@pytest.mark.skipif(not hasattr(torch.nn.functional, "linear_cross_entropy"), reason="torch without linear_cross_entropy")
def test_torch_lce_rows_run_on_the_cpu_and_agree_with_the_reference():
    doc = run_peers(**TINY, dtype="float32", device="cpu", progress=False,
                    systems="softmax-dense,softmax-torch-lce,softmax-torch-lce-chunked")
    rows = _rows(doc)
    for r in doc["rows"]:
        assert r["status"] == "ok" and r["loss_agrees"] is True and r["loss_rel_err"] < 1e-5, r
    assert rows["softmax-torch-lce"]["loss"] == pytest.approx(rows["softmax-dense"]["loss"], rel=1e-6)
    assert rows["softmax-torch-lce"]["note"].startswith("options=None")
    chunked = rows["softmax-torch-lce-chunked"]["note"]
    assert chunked.startswith("options=LinearCrossEntropyOptions(batch_chunk_size=32): 1 batch chunk(s) of [32, C] logits")
    assert "CPU memory leaves out the [32, C] buffers of each chunk" in chunked


def test_torch_lce_rows_really_call_torch_with_their_options(monkeypatch):
    """The rows call F.linear_cross_entropy: plain (options=None) and with the budget's batch chunk."""
    calls = []

    def spy(x, w, y, **kwargs):
        calls.append(kwargs["options"])
        return torch.nn.functional.cross_entropy(x @ w.t(), y)

    monkeypatch.setattr(peers.F, "linear_cross_entropy", spy, raising=False)
    monkeypatch.setattr(torch.nn, "LinearCrossEntropyOptions", lambda **kw: ("options", kw), raising=False)
    monkeypatch.setattr(peers, "LCE_CHUNK_BUDGET_BYTES", 8 * 300 * 5)  # 5 rows of 300 logits
    doc = run_peers(**TINY, device="cpu", progress=False, systems="softmax-torch-lce,softmax-torch-lce-chunked")
    assert [r["status"] for r in doc["rows"]] == ["ok", "ok"], doc["rows"]
    steps = 1 + TINY["warmup"] + TINY["steps"] + 1  # check, warm-up, timed, memory
    assert calls == [None] * steps + [("options", {"batch_chunk_size": 5})] * steps
    assert "7 batch chunk(s) of [5, C] logits" in doc["rows"][1]["note"]  # ceil(32 / 5)


def test_lce_batch_chunk_spends_the_heads_budget():
    assert peers.LCE_CHUNK_BUDGET_BYTES == 64 * 2**20
    assert peers.lce_batch_chunk(256, 400_000) == 20  # 64 MiB / (8 bytes × 400k)
    assert peers.lce_batch_chunk(1024, 1_000_000) == 8
    assert peers.lce_batch_chunk(32, 300) == 32  # never more than the batch
    assert peers.lce_batch_chunk(4, 10**9) == 1  # never less than one row


def test_torch_without_linear_cross_entropy_leaves_the_rows_unavailable(monkeypatch):
    monkeypatch.delattr(peers.F, "linear_cross_entropy", raising=False)
    doc = run_peers(**TINY, device="cpu", progress=False, systems="softmax-torch-lce,softmax-torch-lce-chunked")
    reason = f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    assert [(r["status"], r["reason"]) for r in doc["rows"]] == [("unavailable", reason)] * 2
    assert peers.failures(doc) == []
    monkeypatch.undo()
    if hasattr(peers.F, "linear_cross_entropy"):  # the function without its options class: the chunked row says so
        monkeypatch.delattr(torch.nn, "LinearCrossEntropyOptions", raising=False)
        doc = run_peers(**TINY, device="cpu", progress=False, systems="softmax-torch-lce,softmax-torch-lce-chunked")
        assert [r["status"] for r in doc["rows"]] == ["ok", "unavailable"]
        assert doc["rows"][1]["reason"] == f"torch {torch.__version__} has no torch.nn.LinearCrossEntropyOptions"


# --------------------------------------------------------------------------- arguments and wiring
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch", "0"], "batch must be a positive integer, got 0"),
        (["--steps", "0"], "steps must be an int >= 1, got 0"),
        (["--warmup", "-1"], "warmup must be an int >= 0, got -1"),
        (["--sample-rate", "0"], "sample_rate must be in (0, 1], got 0.0"),
        (["--chunk-size", "0"], "chunk_size must be a positive integer, got 0"),
        (["--systems", "floor,nope"], "systems: unknown 'nope'; choose from floor,"),
        (["--systems", "floor,floor"], "systems: each at most once"),
        (["--margin", "sphereface"], "argument --margin: invalid choice: 'sphereface'"),
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["--chunk-size", "big"], "argument --chunk-size: invalid"),
        # a setting no row reads was dropped silently
        (["--systems", "floor,shardfc-chunked", "--sample-rate", "0.2"],
         "sample_rate=0.2 applies to the shardfc-partial row, not to systems ['floor', 'shardfc-chunked']"),
        (["--systems", "shardfc-partial", "--chunk-size", "64"],
         "chunk_size=64 applies to the shardfc-chunked row, not to systems ['shardfc-partial']"),
        (["--systems", "floor,softmax-dense", "--margin", "cosface"],
         "margin='cosface' applies to the margin rows (the systems not named softmax-* or floor), not to systems "
         "['floor', 'softmax-dense']"),
    ],
)
def test_bad_arguments_are_rejected_before_anything_runs(extra, message):
    code, out, err = _run([*TINY_ARGV, *extra])  # argparse keeps an option's last value
    assert code == 2 and message in err and "[peers]" not in err and out == ""


def test_missing_workload_and_cuda_without_cuda():
    code, _, err = _run(["--batch", "32", "--dim", "16"])
    assert code == 2 and "--classes" in err and "required" in err
    if not torch.cuda.is_available():
        code, _, err = _run([*TINY_ARGV[:-2], "--device", "cuda"])
        assert code == 2 and "device 'cuda': CUDA is not available here" in err


def test_check_workload_names_the_argument():
    with pytest.raises(ValueError, match="margin must be one of arcface"):
        peers.check_workload(32, 16, 300, margin="sphereface", device="cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        peers.check_workload(32, 16, 300, dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="classes must be a positive integer, got True"):
        peers.check_workload(32, 16, True, device="cpu")


def test_the_heads_log_goes_to_stderr_prefixed_and_is_put_back(monkeypatch):
    """impl='auto' logs its timing table on logger shardfc.head at INFO: the CLI shows it on stderr,
    each line prefixed [shardfc.head] (what scripts/gpu_check.sh greps), and leaves the logger as it was."""
    import logging

    log = logging.getLogger("shardfc.head")
    floor = SYSTEMS["floor"]

    def logging_floor(wl, setup):
        log.info("head impl for workload k (median of 5 calls):\n  triton       1.000 ms  chosen\n  torch        9.000 ms")
        log.debug("not shown")
        return floor.build(wl, setup)

    monkeypatch.setitem(SYSTEMS, "floor", peers.System(floor.label, floor.group, logging_floor))
    before = (log.level, list(log.handlers))
    code, out, err = _run([*TINY_ARGV, "--systems", "floor"])
    assert code == 0, err
    assert ("[shardfc.head] head impl for workload k (median of 5 calls):\n"
            "[shardfc.head]   triton       1.000 ms  chosen\n[shardfc.head]   torch        9.000 ms\n") in err
    assert "not shown" not in err and "[shardfc.head]" not in out
    assert (log.level, list(log.handlers)) == before
    code, out, err = _run([*TINY_ARGV, "--systems", "floor", "--quiet"])  # --quiet: only the head's warnings
    assert code == 0 and "[shardfc.head]" not in err
    assert (log.level, list(log.handlers)) == before


def test_help_through_shardfc_bench():
    code, out, _ = _run(["bench", "--peers", "--help"], entry=shardfc_cli.main)
    assert code == 0 and "shardfc bench --peers" in out and "--systems" in out and "--json" in out
    code, out, _ = _run(["bench", "--help"], entry=shardfc_cli.main)
    assert code == 0 and "--peers" in out


def test_a_reason_is_one_line_of_at_most_300_characters():
    """An impl's error in a row: whitespace folded, kept whole up to 300 characters, cut to 300 ending
    in "..." past them; an out-of-memory error says so."""
    whole = "a\n b  " + "z" * 296  # 300 characters once folded
    assert peers._reason(ValueError(whole)) == "ValueError: a b " + "z" * 296
    assert peers._reason(ValueError(whole + "!")) == "ValueError: " + ("a b " + "z" * 296)[:297] + "..."
    assert peers._reason(RuntimeError("CUDA out of memory. Tried")) == "out of memory: CUDA out of memory. Tried"


def test_a_margin_is_taken_by_the_margin_rows_and_arcface_by_default():
    """--margin reaches the workload when a margin row reads it (with softmax rows beside it, too);
    without --margin the margin rows are ArcFace's."""
    given = run_peers(**TINY, device="cpu", progress=False, systems="floor,shardfc-torch,softmax-dense",
                      margin="cosface")
    default = run_peers(**TINY, device="cpu", progress=False, systems="dense")
    assert (given["workload"]["margin"], default["workload"]["margin"]) == ("cosface", "arcface")
    assert all(r["status"] == "ok" for r in given["rows"] + default["rows"])


def test_the_command_line_gives_no_margin_unless_asked():
    """The flag's default is no margin at all (run_peers' ArcFace): a run of rows that read none is not
    refused for a margin nobody gave."""
    code, out, err = _run([*TINY_ARGV, "--systems", "floor", "--quiet"])
    assert code == 0, err
    assert "matmul floor" in out


# ---------------------------------------------------------------- run_peers' bookkeeping over stand-in rows
def _stand_in_rows(monkeypatch, rows, references):
    """run_peers over ``rows`` (system -> fields of its row) instead of running systems, with
    ``references`` (group -> (loss, how)) instead of computing them; returns the calls it saw."""
    seen = {"systems": [], "progress": [], "references": []}

    def run_system(name, wl, setup, progress):
        seen["systems"].append(name)
        seen["progress"].append(progress)
        return peers._blank_row(name) | {"status": "ok", "_comparable": True} | rows[name]

    def reference(wl, setup, group):
        seen["references"].append(group)
        return references[group]

    monkeypatch.setattr(peers, "_run_system", run_system)
    monkeypatch.setattr(peers, "reference_losses", reference)
    monkeypatch.setattr(peers, "_setup", lambda wl: None)
    return seen


def test_rows_are_held_to_their_groups_reference_and_the_floor(monkeypatch, capsys):
    monkeypatch.setitem(peers.LOSS_RTOL, "float32", 0.5)
    rows = {
        "floor": dict(step_time_ms=2.0),
        "dense": dict(step_time_ms=4.0, loss=3.0),  # |3 - 2| / 2 = 0.5: at the tolerance, agrees
        "shardfc-torch": dict(step_time_ms=3.0, loss=3.5, note="its own note"),  # 0.75: disagrees
        "softmax-dense": dict(step_time_ms=1.0, loss=1e-13),  # no reference: the note says why
        "softmax-shardfc-torch": dict(step_time_ms=5.0, loss=2.0, note="kept"),
    }
    seen = _stand_in_rows(monkeypatch, rows, {"margin": (2.0, "dense fp64"), "softmax": (None, "no dense reference here")})
    result = run_peers(batch=8, dim=4, classes=10, systems=list(rows), dtype="float32", device="cpu")
    got = {r["system"]: r for r in result["rows"]}
    assert seen["references"] == ["margin", "softmax"]  # once a group
    assert (got["dense"]["loss_rel_err"], got["dense"]["loss_agrees"]) == (0.5, True)
    assert (got["shardfc-torch"]["loss_rel_err"], got["shardfc-torch"]["loss_agrees"]) == (0.75, False)
    assert got["shardfc-torch"]["reference_loss"] == 2.0 and got["shardfc-torch"]["note"] == "its own note"
    # a group without a reference: every row of it says how, after its own note, and is held to nothing
    assert got["softmax-dense"]["note"] == "no dense reference here" and got["softmax-dense"]["loss_agrees"] is None
    assert got["softmax-shardfc-torch"]["note"] == "kept; no dense reference here"
    assert [got[n]["ratio_to_floor"] for n in rows] == [1.0, 2.0, 1.5, 0.5, 2.5]
    assert peers.failures(result) == ["shardfc-torch: loss 3.5 vs reference 2 (relative error 7.50e-01 > 0.5)"]
    # the defaults: 10 timed steps after 3 warm-up ones, the arcface margin, a line per stage on stderr
    assert (result["workload"]["steps"], result["workload"]["warmup"], result["workload"]["margin"]) == (10, 3, "arcface")
    assert seen["progress"] == [True] * 5 and capsys.readouterr().err.startswith("[peers] cpu, torch ")


def test_a_reference_near_zero_is_divided_by_no_less_than_1e_12(monkeypatch):
    rows = {"dense": dict(step_time_ms=1.0, loss=2e-12)}
    _stand_in_rows(monkeypatch, rows, {"margin": (1e-13, "dense fp64")})
    result = run_peers(batch=8, dim=4, classes=10, systems=["dense"], dtype="float32", progress=False)
    assert result["rows"][0]["loss_rel_err"] == pytest.approx((2e-12 - 1e-13) / 1e-12)
    assert result["workload"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # "auto" by default


def test_no_ratio_without_a_floor_that_ran_in_measurable_time(monkeypatch):
    for floor in (dict(status="failed", step_time_ms=None), dict(step_time_ms=0.0)):
        rows = {"floor": floor, "dense": dict(step_time_ms=4.0, loss=1.0)}
        _stand_in_rows(monkeypatch, rows, {"margin": (1.0, "dense fp64")})
        result = run_peers(batch=8, dim=4, classes=10, systems=["floor", "dense"], dtype="float32", device="cpu",
                           progress=False)
        assert [r["ratio_to_floor"] for r in result["rows"]] == [None, None], floor
