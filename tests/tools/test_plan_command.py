"""``shardfc plan``'s command line (:mod:`shardfc.cli.plan`): what each flag and default hands the plan
(a stand-in records it), what is printed and the JSON written. ``test_plan.py`` and
``test_plan_bytes.py`` run the real plan through it."""

from __future__ import annotations

import json

import pytest

from shardfc.cli import plan as cli

RESULT = {"step_peak": 123, "traffic": {"t": 1}, "chunk_candidates": {"c": 2}}


@pytest.fixture
def planned(monkeypatch):
    calls = []

    def plan(*args, **kwargs):
        calls.append((args, kwargs))
        return {k: v for k, v in RESULT.items() if k == "step_peak" or kwargs.get("traffic")}

    monkeypatch.setattr(cli, "plan", plan)
    monkeypatch.setattr(cli, "format_plan", lambda result: f"PLAN {result['step_peak']}")
    monkeypatch.setattr(cli, "format_traffic", lambda traffic: f"TRAFFIC {traffic}")
    monkeypatch.setattr(cli, "format_chunk_candidates", lambda c: f"CHUNKS {c}")
    return calls


REQUIRED = ["--classes", "20", "--dim", "8", "--batch", "4"]


def test_the_defaults(planned, capsys):
    assert cli.main(REQUIRED) == 0
    (args, kwargs), = planned
    assert args == (20, 8, 4, 1, "float32", "sgd", 1.0, None, None)
    assert kwargs == dict(margin="arcface", weight_decay=0.0, memory_model="allocated", grad_in_place=True,
                          sparse_grad=False, subcenters=1, impl="torch", sms=132, fused_update=False,
                          compute_dtype=None, traffic=False, l2_bytes="50MiB", gpu_chunk_scale=None)
    assert capsys.readouterr().out == "PLAN 123\n"


def test_every_flag_reaches_the_plan(planned, capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main(REQUIRED + [
        "--world-size", "8", "--dtype", "bfloat16", "--optimizer", "adamw", "--sample-rate", "0.1",
        "--budget", "16GiB", "--margin", "cosface", "--weight-decay", "5e-4",
        "--memory-model", "allocated", "--no-grads-kept", "--sparse-grad", "--subcenters", "3", "--head-impl", "gemm",
        "--sms", "114", "--fused-update", "--compute-dtype", "bfloat16", "--bytes", "--l2", "40MiB",
        "--gpu-chunk-scale", "4", "--json", str(out)]) == 0
    (args, kwargs), = planned
    assert args == (20, 8, 4, 8, "bfloat16", "adamw", 0.1, None, "16GiB")
    assert kwargs == dict(margin="cosface", weight_decay=5e-4, memory_model="allocated", grad_in_place=False,
                          sparse_grad=True, subcenters=3, impl="gemm", sms=114, fused_update=True,
                          compute_dtype="bfloat16", traffic=True, l2_bytes="40MiB", gpu_chunk_scale=4)
    assert capsys.readouterr().out == "PLAN 123\n\nTRAFFIC {'t': 1}\n\nCHUNKS {'c': 2}\n"
    assert out.read_text() == json.dumps(RESULT, indent=2) + "\n"
    planned.clear()
    assert cli.main(REQUIRED + ["--chunk-size", "512"]) == 0  # the torch path's own
    assert cli.main(REQUIRED + ["--chunk-size", "auto", "--head-impl", "torch"]) == 0
    assert [call[0][7] for call in planned] == [512, "auto"]


@pytest.mark.parametrize("argv", [["--dtype", "int8"], ["--classes", "many"], ["--weight-decay", "x"], ["--bogus"]])
def test_a_bad_option_exits_2(planned, capsys, argv):
    assert cli.main(REQUIRED + argv) == 2
    assert planned == [] and "shardfc plan: error: " in capsys.readouterr().err


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_a_chunk_size_with_a_gpu_path_is_refused(planned, capsys, impl):
    # the GPU paths hold no logits to walk in chunks: the flag was dropped silently
    assert cli.main(REQUIRED + ["--chunk-size", "auto", "--head-impl", impl]) == 2
    assert planned == [] and capsys.readouterr().err == (
        f"shardfc plan: error: --chunk-size auto walks the torch path's logits in chunks: --head-impl {impl} holds "
        "none (its chunks are --gpu-chunk-scale's)\n")


@pytest.mark.parametrize("argv, message", [
    # the torch path reads neither: each was dropped silently
    (["--sms", "100"], "--sms 100 sizes the GPU paths' statistics: it needs --head-impl triton or gemm"),
    (["--l2", "40MiB"], "--l2 40MiB sizes the GPU paths' chunks and the --bytes model: it needs --head-impl triton "
                        "or gemm, or --bytes"),
])
def test_a_gpu_setting_without_a_gpu_path_is_refused(planned, capsys, argv, message):
    assert cli.main(REQUIRED + argv) == 2
    assert planned == [] and capsys.readouterr().err == f"shardfc plan: error: {message}\n"
    assert cli.main(REQUIRED + argv[:2] + ["--head-impl", "triton"]) == 0
    if argv[0] == "--l2":
        assert cli.main(REQUIRED + argv + ["--bytes"]) == 0  # the torch path's --bytes model reads it
        assert planned[-1][1]["l2_bytes"] == "40MiB"


@pytest.mark.parametrize("missing", ["--classes", "--dim", "--batch"])
def test_each_size_is_required(planned, capsys, missing):
    argv = [a for i, a in enumerate(REQUIRED) if missing not in (a, REQUIRED[i - 1] if i else None)]
    assert cli.main(argv) == 2
    assert planned == [] and f"the following arguments are required: {missing}" in capsys.readouterr().err


def test_help_exits_0(planned, capsys):
    assert cli.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: shardfc plan ")


def test_a_plan_error_is_one_line(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise ValueError("chunk_size must be >= 1, got 0")

    monkeypatch.setattr(cli, "plan", refuse)
    assert cli.main(REQUIRED) == 2
    assert capsys.readouterr() == ("", "shardfc plan: error: chunk_size must be >= 1, got 0\n")
