"""``impl="auto"`` in a process group: the ranks agree on one implementation, or all raise one error.

The same cases as ``fused/test_fused_distributed.py``'s gloo ranks, with ranks as threads of this
process (``thread_world.ThreadWorld``), where mutation testing sees the head's side of the
agreement (``_impl_for``, ``_local_view``, ``_gather_codes``, ``_choose_impl``, ``_timed_step``).
Each rank gets what a process of its own would have: its own ``$SHARDFC_HEAD_IMPL`` (through the
``os`` that :mod:`shardfc.head.impl_select` reads), its own selector and cache file, and Triton or
not (a rank "with Triton" resolves as on a GPU). Nothing here runs a fused kernel: where a fused
implementation is timed or chosen, the torch kernels stand in for it, and each rank's stub clock
says which candidate is fastest there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading

import pytest
import torch

import shardfc
from shardfc.head import function, impl_select
from shardfc.head import module as head_module
from thread_world import ThreadWorld

C, D = 11, 4
RANK = threading.local()


class _OsOfRank:
    """``os`` as ``impl_select`` sees it on the calling rank: ``$SHARDFC_HEAD_IMPL`` is that rank's."""

    def __init__(self, env: dict) -> None:
        self.env = env

    @property
    def environ(self) -> dict:
        environ = {k: v for k, v in os.environ.items() if k != impl_select.ENV_VAR}
        if RANK.rank in self.env:
            environ[impl_select.ENV_VAR] = self.env[RANK.rank]
        return environ

    def __getattr__(self, name):
        return getattr(os, name)


def _clock(ms):
    """A clock under which the i-th timed call lasts ``ms[i]`` milliseconds (one step, no warm-up:
    each candidate reads it twice)."""
    reads = {"n": 0, "now": 0.0}

    def clock():
        call, end = divmod(reads["n"], 2)
        reads["n"] += 1
        if end:
            reads["now"] += ms[call] / 1000
        return reads["now"]

    return clock


def _torch_kernels_stand_in(monkeypatch):
    """The torch kernels stand in for the fused ones, in the timing and in the step; the real
    ``shard_kernels`` is returned."""
    real = function.shard_kernels

    def kernels(cfg):
        return real(dataclasses.replace(cfg, impl="torch"))

    monkeypatch.setattr(head_module, "shard_kernels", kernels)
    monkeypatch.setattr(function, "shard_kernels", kernels)
    return real


def _steps(world, monkeypatch, tmp_path, env=None, without_triton=(), candidates=None, ms=None, steps=2,
           chunk_scale=None, dtype=torch.float64):
    """Each rank's ``(last_impl, last_chunk_scale, its selector)`` after ``steps`` training steps of a
    fresh head under ``impl="auto"``, or ``("error", message, this rank's cause)``."""
    monkeypatch.setattr(impl_select, "os", _OsOfRank(env or {}))
    real_resolve = head_module.resolve_impl

    def resolve(impl, device, compute, stats):  # a rank with Triton resolves as on a GPU
        assert (device, compute, stats) == (torch.device("cpu"), dtype, dtype)  # what it is asked about
        if RANK.rank in without_triton:
            return real_resolve(impl, device, compute, stats)
        return impl

    monkeypatch.setattr(head_module, "resolve_impl", resolve)
    _torch_kernels_stand_in(monkeypatch)
    if candidates is not None:
        monkeypatch.setattr(head_module, "timed_candidates", lambda scale: candidates)
    selectors = {}
    monkeypatch.setattr(impl_select, "default_selector", lambda: selectors[RANK.rank])

    def rank_main(rank):
        RANK.rank = rank
        clock = _clock(ms[rank]) if ms is not None else None
        selectors[rank] = impl_select.ImplSelector(tmp_path / f"rank{rank}.json", steps=1, warmup=0, clock=clock,
                                                   sync=lambda: None)
        head = shardfc.ShardedMarginHead(D, C, impl="auto", dtype=dtype, gpu_chunk_scale=chunk_scale)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(rank + 2, D, generator=g, dtype=dtype), torch.randint(0, C, (rank + 2,), generator=g)
        try:
            for _ in range(steps):
                head(x.requires_grad_(), y).backward()
        except ValueError as e:
            return "error", str(e), None if e.__cause__ is None else str(e.__cause__)
        return head.last_impl, head.last_chunk_scale, selectors[rank]

    return ThreadWorld(world).results(rank_main, monkeypatch)


def _agreements(monkeypatch):
    """Per rank, the collectives of the agreement it entered: ``"settle"`` (every rank's view,
    :meth:`~shardfc.head.module.ShardedMarginHead._gather_codes`) and ``"pick"`` (rank 0's timed
    choice, through ``choose``'s ``agree``)."""
    calls = []
    gather, choose = head_module.ShardedMarginHead._gather_codes, impl_select.ImplSelector.choose

    def gather_codes(self, code):
        calls.append((self.rank, "settle"))
        return gather(self, code)

    def choose_agreed(self, key, candidates, agree=None, **kwargs):
        def counted(i):
            calls.append((RANK.rank, "pick"))
            return agree(i)

        return choose(self, key, candidates, None if agree is None else counted, **kwargs)

    monkeypatch.setattr(head_module.ShardedMarginHead, "_gather_codes", gather_codes)
    monkeypatch.setattr(impl_select.ImplSelector, "choose", choose_agreed)
    return calls


def test_an_override_on_one_rank_only_is_the_same_error_on_every_rank(monkeypatch, tmp_path):
    got = _steps(3, monkeypatch, tmp_path, env={1: "torch"})
    message = ("SHARDFC_HEAD_IMPL differs across ranks: ranks 0,2 unset, rank 1 'torch'; "
               "set it on every rank or on none")
    assert got == [("error", message, None)] * 3


def test_an_invalid_override_is_an_error_on_every_rank_caused_by_the_value_where_it_was_set(monkeypatch, tmp_path):
    got = _steps(2, monkeypatch, tmp_path, env={0: "cudnn", 1: "torch"})
    message = ("SHARDFC_HEAD_IMPL names no implementation of the head on rank 0 (see the error there); "
               "set it to one of triton, gemm, torch on every rank, or leave it unset on every rank")
    assert got[0] == ("error", message, "SHARDFC_HEAD_IMPL='cudnn' is not an implementation of the head; "
                                        "choose from auto, triton, gemm, torch")
    assert got[1] == ("error", message, None)


def test_an_override_that_cannot_run_on_one_rank_is_an_error_on_every_rank(monkeypatch, tmp_path):
    got = _steps(3, monkeypatch, tmp_path, env={0: "triton", 1: "triton", 2: "triton"}, without_triton=(2,))
    message = ("SHARDFC_HEAD_IMPL='triton' cannot run on rank 2 (see the error there); "
               "name an implementation every rank can run, e.g. torch")
    assert got[0] == got[1] == ("error", message, None)
    assert got[2][:2] == ("error", message)
    assert got[2][2].startswith("impl='triton' cannot run: the head's tensors are on cpu, not a CUDA device")


def test_an_override_on_every_rank_runs_without_timing_and_one_collective(monkeypatch, tmp_path, caplog):
    calls = _agreements(monkeypatch)
    with caplog.at_level(logging.INFO, "shardfc.head"):
        got = _steps(2, monkeypatch, tmp_path, env={0: "gemm", 1: "gemm"}, steps=3)
    for impl, scale, selector in got:
        assert (impl, scale, selector.timings) == ("gemm", None, {})  # None: the GPU paths' default scale
    assert sorted(calls) == [(0, "settle"), (1, "settle")]  # at the first step only
    assert "(SHARDFC_HEAD_IMPL on every rank)" in caplog.text


@pytest.mark.parametrize("interpreting, dtype, why", [
    (False, torch.float64, "the head's tensors are on cpu, not a CUDA device (TRITON_INTERPRET=1 runs"),
    (True, torch.float64, "the kernels keep fp32 statistics; inputs of torch.float64 need impl='torch')"),
    (True, torch.float32, "the head's tensors are on cpu, not a CUDA device)"),  # the kernels could run, not auto
], ids=["cpu", "interpreter fp64", "interpreter fp32"])
def test_torch_on_every_rank_when_one_cannot_run_the_fused_kernels(monkeypatch, tmp_path, caplog, interpreting,
                                                                     dtype, why):
    from shardfc.head import fused

    monkeypatch.setattr(fused, "interpreting", lambda: interpreting)
    with caplog.at_level(logging.WARNING, "shardfc.head"):
        got = _steps(3, monkeypatch, tmp_path, without_triton=(1,), dtype=dtype)
    for impl, scale, selector in got:
        assert (impl, scale, selector.timings) == ("torch", None, {})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 3 and all("as the fused kernels cannot run on rank 1" in w for w in warned)
    assert sum(f"(here: {why}" in w for w in warned) == 1


def test_torch_without_a_word_when_no_rank_can_run_the_fused_kernels(monkeypatch, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "shardfc.head"):
        got = _steps(2, monkeypatch, tmp_path, without_triton=(0, 1))
    assert [g[:2] for g in got] == [("torch", None)] * 2
    assert not caplog.records


def test_the_ranks_time_the_candidates_and_all_run_rank_0s_fastest(monkeypatch, tmp_path):
    calls = _agreements(monkeypatch)
    candidates = ("triton@1", "gemm@2", "torch")
    ms = {0: [3.0, 1.0, 2.0], 1: [3.0, 2.0, 1.0]}  # rank 0: gemm@2 fastest; rank 1: torch
    got = _steps(2, monkeypatch, tmp_path, candidates=candidates, ms=ms, steps=3)
    for rank, (impl, scale, selector) in enumerate(got):
        assert (impl, scale) == ("gemm", 2)
        (times,) = selector.timings.values()
        assert times == pytest.approx({"triton@1": ms[rank][0], "gemm@2": ms[rank][1], "torch": ms[rank][2]})
    # the views, then rank 0's pick, at the first step only
    assert sorted(calls) == [(0, "pick"), (0, "settle"), (1, "pick"), (1, "settle")]
    written = [p.name for p in tmp_path.iterdir()]
    assert written == ["rank0.json"]  # the choice is written by rank 0 alone


def test_a_chunk_scale_given_times_only_that_scale(monkeypatch, tmp_path):
    timed = []
    real = head_module.ShardedMarginHead._timed_step

    def spy(cfg, *args):
        timed.append((RANK.rank, cfg.impl, cfg.chunk_scale))  # the ranks time at once: note whose
        return real(cfg, *args)

    monkeypatch.setattr(head_module.ShardedMarginHead, "_timed_step", staticmethod(spy))
    ms = {r: [2.0, 1.0, 3.0] for r in range(2)}  # triton@4, gemm@4, torch
    got = _steps(2, monkeypatch, tmp_path, ms=ms, chunk_scale=4)
    assert [g[:2] for g in got] == [("gemm", 4)] * 2
    for rank in (0, 1):
        assert [t[1:] for t in timed if t[0] == rank] == [("triton", 4), ("gemm", 4), ("torch", None)]



# ---- one process: nothing to agree on


def _resolves_as_on_a_gpu(impl, device, compute, stats):
    assert (device, compute, stats) == (torch.device("cpu"), torch.float64, torch.float64)
    return impl


def _one_process(monkeypatch, tmp_path, impl="auto", env=None, sample_rate=1.0, steps=2):
    """``(head, selector)`` after ``steps`` training steps of one process "with Triton"."""
    RANK.rank = 0  # the stand-ins below are the ranks' (see _steps)
    monkeypatch.setattr(impl_select, "os", _OsOfRank({} if env is None else {0: env}))
    monkeypatch.setattr(head_module, "resolve_impl", _resolves_as_on_a_gpu)
    _torch_kernels_stand_in(monkeypatch)
    selector = impl_select.ImplSelector(tmp_path / "cache.json", steps=1, warmup=0, sync=lambda: None,
                                        clock=_clock([3.0, 1.0, 2.0]))  # timed once: gemm@2 fastest
    monkeypatch.setattr(impl_select, "default_selector", lambda: selector)
    monkeypatch.setattr(head_module, "timed_candidates", lambda scale: ("triton@1", "gemm@2", "torch"))
    head = shardfc.ShardedMarginHead(D, C, impl=impl, dtype=torch.float64, sample_rate=sample_rate)
    x, y = torch.randn(5, D, dtype=torch.float64), torch.randint(0, C, (5,))
    for _ in range(steps):
        head(x, y).backward()
    return head, selector


@pytest.mark.parametrize("impl", ["torch", "gemm", "triton"])
def test_an_impl_named_is_run_as_named_whatever_the_environment_says(monkeypatch, tmp_path, impl):
    head, selector = _one_process(monkeypatch, tmp_path, impl=impl, env="gemm" if impl != "gemm" else "torch")
    assert head.last_impl == impl and selector.timings == {} and selector.choices == {}


def test_auto_in_one_process_follows_the_environment_every_forward(monkeypatch, tmp_path):
    head, selector = _one_process(monkeypatch, tmp_path, env="gemm")
    assert (head.last_impl, head.last_chunk_scale, selector.timings) == ("gemm", None, {})


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_auto_in_one_process_times_once_under_the_forwards_workload_key(monkeypatch, tmp_path, sample_rate):
    head, selector = _one_process(monkeypatch, tmp_path, sample_rate=sample_rate, steps=3)
    assert (head.last_impl, head.last_chunk_scale) == ("gemm", 2)  # the stub clock's fastest
    key = head_module.workload_key(head, 5, torch.float64, torch.float64, torch.device("cpu"), sample_rate < 1.0)
    assert list(selector.timings) == [key] and selector.choices == {key: "gemm@2"}
    if sample_rate < 1.0:  # a sampled forward's workload is not the dense one's
        assert key != head_module.workload_key(head, 5, torch.float64, torch.float64, torch.device("cpu"), False)


def test_the_ranks_agree_under_the_forwards_workload_key(monkeypatch, tmp_path):
    ms = {0: [3.0, 1.0, 2.0], 1: [3.0, 1.0, 2.0]}
    got = _steps(2, monkeypatch, tmp_path, candidates=("triton@1", "gemm@2", "torch"), ms=ms)
    from shardfc.parallel.context import DistContext

    head = shardfc.ShardedMarginHead(D, C, dtype=torch.float64, context=DistContext())
    head.world_size = 2  # as the ranks' heads: the key holds the world's size
    key = head_module.workload_key(head, 2 + 3, torch.float64, torch.float64, torch.device("cpu"), False)
    for _, _, selector in got:
        assert list(selector.timings) == [key] and selector.choices == {key: "gemm@2"}


# ---- what the timing runs (ShardedMarginHead._timed_step), recorded through the stand-in kernels


@pytest.mark.parametrize("kw", [{}, {"sample_rate": 0.5}, {"subcenters": 2},
                                {"margin": shardfc.margins.SphereFace(4)}, {"interclass_filter_threshold": 0.9}],
                         ids=["full", "partial fc", "sub-centres", "sphereface", "filter"])
@pytest.mark.parametrize("x_dtype", [torch.float64, torch.bfloat16])
def test_the_timing_runs_the_whole_shards_forward_and_its_backward_in_slices(monkeypatch, tmp_path, kw, x_dtype):
    """Per timed call of a fused candidate: its forward over every scored class of the shard (the
    autotune key the run uses), then the backward ``k = ⌈n / AUTO_TIMED_CLASSES⌉`` times over the
    first ``⌈n / k⌉`` classes, from statistics made once (the first call) by the gemm forward of that
    slice; torch's candidate runs forward and backward ``k`` times on the slice. Nothing else: the
    batch's own rows, the labels of classes outside the slice ignored, the sample's mean as upstream
    gradient, the norms only where the margin needs them, the target rows only with the filter."""
    RANK.rank = 0
    monkeypatch.setattr(head_module, "AUTO_TIMED_CLASSES", 4)  # 11 classes: k = 3 slices of 4
    monkeypatch.setattr(impl_select, "os", _OsOfRank({}))
    monkeypatch.setattr(head_module, "resolve_impl", lambda impl_, *args: impl_)
    real_kernels = _torch_kernels_stand_in(monkeypatch)  # the step's; the timing's record, below
    calls, inside = [], []

    def recording(cfg):
        forward, backward = real_kernels(dataclasses.replace(cfg, impl="torch"))

        def fwd(a, w, labels, norm, cfg_, rows=None, **extra):
            calls.append(("forward", cfg_.impl, cfg_.num_classes, w.shape[0] if rows is None else rows.numel(),
                          labels.clone(), norm, sorted(extra)))
            inside.append((torch.is_autocast_enabled("cpu"), cfg_.stats_dtype, None if norm is None else
                           (norm.shape, norm.dtype), tuple(t.dtype for t in extra.values())))
            return forward(a, w, labels, norm, cfg_, rows=rows, **extra)

        def bwd(a, w, labels, norm, stats, row_max, sum_exp, coef, cfg_, grad, rows=None, **extra):
            calls.append(("backward", cfg_.impl, cfg_.num_classes, w.shape[0] if rows is None else rows.numel(),
                          labels.clone(), coef.clone(), grad, sorted(extra)))
            # the torch backward frees the forward's saved logits; a fused one reuses its statistics
            stats = dataclasses.replace(stats, buffers=None if stats.buffers is None else list(stats.buffers))
            return backward(a, w, labels, norm, stats, row_max, sum_exp, coef, cfg_, grad, rows=rows, **extra)

        return fwd, bwd

    monkeypatch.setattr(head_module, "shard_kernels", recording)
    monkeypatch.setattr(head_module, "timed_candidates", lambda scale: ("triton@1", "torch"))
    selector = impl_select.ImplSelector(tmp_path / "cache.json", steps=1, warmup=1, sync=lambda: None)
    monkeypatch.setattr(impl_select, "default_selector", lambda: selector)
    head_dtype = torch.float64 if x_dtype == torch.float64 else torch.float32
    head = shardfc.ShardedMarginHead(D, C, impl="auto", dtype=head_dtype, **kw)
    x, y = torch.randn(5, D, dtype=x_dtype), torch.tensor([0, 3, 4, 7, 10])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=x_dtype == torch.bfloat16):
        head(x, y)  # the forward only: every kernel call recorded is the timing's
    # autocast off inside (the kernels pick their dtypes), the norms and target rows per sample in the
    # statistics' dtype (fp32 for bf16 embeddings)
    sd = torch.float64 if x_dtype == torch.float64 else torch.float32
    norms = (torch.Size([5]), sd) if "margin" in kw else None
    extras = (sd,) if "interclass_filter_threshold" in kw else ()
    assert set(inside) == {(False, sd, norms, extras)}
    K = head.subcenters
    n = head.sampled_rows[0].numel() // K if kw.get("sample_rate") else C
    k = -(-n // 4)
    s = -(-n // k)  # the slice's classes
    assert selector.failures == {next(iter(selector.timings)): {}}
    fused, plain = calls[: 3 + 2 * k], calls[3 + 2 * k:]
    # the fused candidate, two calls (warm-up and timed): the whole shard, the slice's statistics once, k backwards
    assert [c[:4] for c in fused] == (
        [("forward", "triton", n, n * K), ("forward", "gemm", s, s * K)] + [("backward", "triton", s, s * K)] * k
        + [("forward", "triton", n, n * K)] + [("backward", "triton", s, s * K)] * k)
    # torch's, two calls: forward and backward k times each, on the slice
    assert [c[:4] for c in plain] == [("forward", "torch", s, s * K), ("backward", "torch", s, s * K)] * k * 2
    local = head.sampled_rows[0] if kw.get("sample_rate") else None
    for c in calls:
        whole = c[2] == n and c[1] == "triton" and c[0] == "forward"
        want = y if local is None else torch.searchsorted(local[::K] // K, y)  # labels in the scored classes
        want = want if whole else torch.where(want < s, want, torch.full_like(want, -1))
        assert torch.equal(c[4], want), c[:4]
        extra = ["target_rows"] if "interclass_filter_threshold" in kw else []
        assert c[-1] == extra
        if c[0] == "forward":
            assert (c[5] is None) != ("margin" in kw)  # SphereFace's norms only
        else:
            assert torch.equal(c[5], torch.full((5,), 1 / 5, dtype=sd)) and c[6] is None



def test_the_workload_key_says_when_the_update_is_fused_into_the_backward(monkeypatch, tmp_path):
    """The timing key of a forward whose backward also applies the optimizer's update, in one process
    and on every rank of a group."""
    from test_module_fused_handover import StandInOptimizer

    monkeypatch.setattr(head_module, "resolve_impl", _resolves_as_on_a_gpu)
    monkeypatch.setattr(impl_select, "os", _OsOfRank({}))
    cpu, f64 = torch.device("cpu"), torch.float64
    kept = []

    def key_of(head):
        opt = StandInOptimizer()
        kept.append(opt)  # held weakly by the head
        head.fuse_optimizer_update(opt)
        impl, key = head._impl_for(cpu, f64, f64, f64, 6, True)
        assert impl == "auto" and key == head_module.workload_key(head, 6, f64, f64, cpu, True, True)
        return json.loads(key)["fused_update"]

    RANK.rank = 0
    selectors = {}
    monkeypatch.setattr(impl_select, "default_selector", lambda: selectors[RANK.rank])
    selectors[0] = impl_select.ImplSelector(tmp_path / "one.json")
    assert key_of(shardfc.ShardedMarginHead(D, C, sample_rate=0.5, dtype=f64)) is True

    def rank_main(rank):
        RANK.rank = rank
        selectors[rank] = impl_select.ImplSelector(tmp_path / f"rank{rank}.json")
        return key_of(shardfc.ShardedMarginHead(D, C, sample_rate=0.5, dtype=f64))

    assert ThreadWorld(2).results(rank_main, monkeypatch) == [True, True]



def test_auto_named_in_the_environment_is_as_if_unset(monkeypatch, tmp_path):
    candidates, ms = ("triton@1", "gemm@2", "torch"), {0: [3.0, 1.0, 2.0], 1: [1.0, 2.0, 3.0]}
    got = _steps(2, monkeypatch, tmp_path, env={0: "auto", 1: "auto"}, candidates=candidates, ms=ms)
    assert [g[:2] for g in got] == [("gemm", 2)] * 2  # timed, rank 0's fastest


def test_auto_named_in_the_environment_of_one_process_is_as_if_unset(monkeypatch, tmp_path):
    head, selector = _one_process(monkeypatch, tmp_path, env="auto")
    assert head.last_impl == "gemm" and len(selector.timings) == 1


def test_one_process_takes_its_cached_choice_without_timing(monkeypatch, tmp_path):
    """The cache file's entry for the workload (what an earlier run timed) is used as is."""
    head = shardfc.ShardedMarginHead(D, C, dtype=torch.float64)
    key = head_module.workload_key(head, 5, torch.float64, torch.float64, torch.device("cpu"), False)
    (tmp_path / "cache.json").write_text(json.dumps({key: {"impl": "triton@1"}}))
    head, selector = _one_process(monkeypatch, tmp_path)
    assert (head.last_impl, head.last_chunk_scale, selector.timings) == ("triton", 1, {})
