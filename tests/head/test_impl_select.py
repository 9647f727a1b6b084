"""ImplSelector without a GPU: stub clock, sync and candidates; the JSON cache in tmp_path; two
ranks simulated in one process through a fake ``agree``."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from shardfc.head import impl_select as S

KEY = S.workload_key(classes=S.bucket(1_000_000), batch=S.bucket(500), dtype=torch.bfloat16, gpu="stub")


@pytest.fixture(autouse=True)
def _no_real_home(tmp_path, monkeypatch):
    """Whatever a test forgets, nothing reaches the real home or the real cache folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(S.CACHE_DIR_VAR, str(tmp_path / "default-cache"))
    monkeypatch.delenv(S.ENV_VAR, raising=False)
    monkeypatch.setattr(S, "_default", None)


class Bench:
    """A fake clock that candidates advance by their cost; records every call."""

    def __init__(self):
        self.now = 0.0
        self.clock_calls = 0
        self.sync_calls = 0
        self.calls = []  # candidate names, in call order

    def clock(self):
        self.clock_calls += 1
        return self.now

    def sync(self):
        self.sync_calls += 1

    def candidates(self, **costs):
        """name -> callable costing ``costs[name]`` seconds (an exception instance: raises it)."""

        def make(name, cost):
            def run():
                self.calls.append(name)
                if isinstance(cost, BaseException):
                    raise cost
                self.now += cost

            return run

        return {name: make(name, cost) for name, cost in costs.items()}

    def selector(self, path, **kw):
        return S.ImplSelector(path, clock=self.clock, sync=self.sync, **kw)


def _read_only_replace(src, dst):
    """``os.replace`` on a read-only file system."""
    raise PermissionError(13, "Read-only file system", str(dst))


def _rank0_agree(record):
    def agree(i):
        record.append(i)
        return i

    return agree


def _follower_agree(rank0_values, record):
    values = iter(rank0_values)

    def agree(i):
        record.append(i)
        return next(values)

    return agree


# ---------------------------------------------------------------------- timing
def test_picks_the_fastest_and_reports_median_ms(tmp_path):
    b = Bench()
    sel = b.selector(tmp_path / "c.json")
    name = sel.choose(KEY, b.candidates(triton=0.003, gemm=0.001, torch=0.002))
    assert name == "gemm" and sel.choices[KEY] == "gemm"
    assert sel.timings[KEY] == pytest.approx({"triton": 3.0, "gemm": 1.0, "torch": 2.0})
    assert sel.failures[KEY] == {}


def test_ties_go_to_the_first_in_order(tmp_path):
    b = Bench()
    assert b.selector(tmp_path / "c.json").choose(KEY, b.candidates(triton=0.002, gemm=0.001, torch=0.001)) == "gemm"
    b = Bench()
    assert b.selector(tmp_path / "d.json").choose(KEY, b.candidates(triton=0.001, gemm=0.001, torch=0.001)) == "triton"


def test_warmup_calls_are_run_but_not_timed(tmp_path):
    b = Bench()
    b.selector(tmp_path / "c.json", steps=4, warmup=3).choose(KEY, b.candidates(triton=0.001, gemm=0.002))
    assert b.calls == ["triton"] * 7 + ["gemm"] * 7  # in the order given, one candidate at a time
    assert b.clock_calls == 2 * 4 * 2  # before and after each timed call only
    assert b.sync_calls == 2 * 4 * 2


def test_median_not_mean(tmp_path):
    b = Bench()
    costs = iter([0.001, 0.001, 0.100, 0.001, 0.001])  # one slow outlier

    def jumpy():
        b.now += next(costs)

    sel = b.selector(tmp_path / "c.json", steps=5, warmup=0)
    sel.choose(KEY, {"triton": jumpy, "torch": b.candidates(torch=0.002)["torch"]})
    assert sel.timings[KEY]["triton"] == pytest.approx(1.0)
    assert sel.choices[KEY] == "triton"


def test_a_failing_candidate_is_skipped_and_reported(tmp_path, caplog):
    b = Bench()
    sel = b.selector(tmp_path / "c.json", steps=3)
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        name = sel.choose(KEY, b.candidates(triton=RuntimeError("boom\nsecond line"), gemm=0.002, torch=0.001))
    assert name == "torch"
    assert b.calls.count("triton") == 1  # the warm-up raised: no timed call
    assert sel.timings[KEY]["triton"] == math.inf
    assert sel.failures[KEY] == {"triton": "RuntimeError: boom"}
    table = [r.getMessage() for r in caplog.records if "median of 3" in r.getMessage()]
    assert len(table) == 1
    assert "triton  failed: RuntimeError: boom" in table[0]
    assert "torch" in table[0] and "chosen" in table[0]
    assert S.short_key(KEY) in table[0] and str(tmp_path / "c.json") in table[0]
    saved = json.loads((tmp_path / "c.json").read_text())[KEY]
    assert saved["times_ms"]["triton"] is None  # strict JSON: no Infinity


def test_out_of_memory_frees_the_cache(tmp_path, monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    b = Bench()
    sel = b.selector(tmp_path / "c.json")
    name = sel.choose(KEY, b.candidates(triton=torch.cuda.OutOfMemoryError("CUDA out of memory"), torch=0.001))
    assert name == "torch" and emptied == [1]
    assert sel.failures[KEY]["triton"].startswith("OutOfMemoryError: CUDA out of memory")


def test_every_candidate_failing_raises_naming_each(tmp_path):
    b = Bench()
    sel = b.selector(tmp_path / "c.json")
    cands = b.candidates(triton=ValueError("no triton"), gemm=RuntimeError("gemm broke"), torch=RuntimeError("torch broke"))
    with pytest.raises(RuntimeError) as info:
        sel.choose(KEY, cands)
    for text in ("triton: ValueError: no triton", "gemm: RuntimeError: gemm broke", "torch: RuntimeError: torch broke"):
        assert text in str(info.value)
    assert KEY not in sel.choices and not (tmp_path / "c.json").exists()


def test_interrupts_are_not_swallowed(tmp_path):
    b = Bench()
    with pytest.raises(KeyboardInterrupt):
        b.selector(tmp_path / "c.json").choose(KEY, b.candidates(triton=KeyboardInterrupt(), torch=0.001))


def test_bad_arguments(tmp_path):
    b = Bench()
    with pytest.raises(ValueError, match="steps"):
        b.selector(tmp_path / "c.json", steps=0)
    with pytest.raises(ValueError, match="warmup"):
        b.selector(tmp_path / "c.json", warmup=-1)
    with pytest.raises(ValueError, match="candidates: unknown 'auto'"):
        b.selector(tmp_path / "c.json").choose(KEY, b.candidates(auto=0.001))
    with pytest.raises(ValueError, match="candidates"):
        b.selector(tmp_path / "c.json").choose(KEY, {})


# ---------------------------------------------------------------------- caches
def test_in_memory_cache_times_nothing_the_second_time(tmp_path):
    b = Bench()
    sel = b.selector(tmp_path / "c.json")
    cands = b.candidates(triton=0.001, torch=0.002)
    assert sel.choose(KEY, cands) == "triton"
    calls, clocks = len(b.calls), b.clock_calls
    (tmp_path / "c.json").unlink()  # not even the file is read again
    assert sel.choose(KEY, cands, agree=lambda i: pytest.fail("no collective on a memory hit")) == "triton"
    assert (len(b.calls), b.clock_calls) == (calls, clocks)
    assert not (tmp_path / "c.json").exists()


def test_file_cache_serves_a_new_selector_without_running_anything(tmp_path, caplog):
    path = tmp_path / "sub" / "dir" / "c.json"  # the folders are created
    b = Bench()
    assert b.selector(path).choose(KEY, b.candidates(triton=0.002, gemm=0.001)) == "gemm"
    entry = json.loads(path.read_text())[KEY]
    assert entry["impl"] == "gemm" and entry["times_ms"] == pytest.approx({"triton": 2.0, "gemm": 1.0})
    assert entry["when"].endswith("+00:00")
    assert [p.name for p in path.parent.iterdir()] == ["c.json"]  # no temp file left

    b2 = Bench()
    sel2 = b2.selector(path)
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert sel2.choose(KEY, b2.candidates(triton=0.0001, gemm=0.001)) == "gemm"
    assert b2.calls == [] and b2.clock_calls == 0 and KEY not in sel2.timings
    assert any("gemm (cached in" in r.getMessage() for r in caplog.records)


def test_a_cached_name_no_longer_offered_is_no_entry(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({KEY: {"impl": "triton", "times_ms": {}, "when": "x"}}))
    b = Bench()
    assert b.selector(path).choose(KEY, b.candidates(gemm=0.002, torch=0.001)) == "torch"
    assert b.calls and json.loads(path.read_text())[KEY]["impl"] == "torch"


def test_writing_merges_with_other_keys(tmp_path):
    path = tmp_path / "c.json"
    other = {"impl": "torch", "times_ms": {"torch": 1.0}, "when": "2026-01-01T00:00:00+00:00"}
    path.write_text(json.dumps({"other-key": other}))
    b = Bench()
    b.selector(path).choose(KEY, b.candidates(triton=0.001, torch=0.002))
    data = json.loads(path.read_text())
    assert data["other-key"] == other and data[KEY]["impl"] == "triton"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\xff\xfe"])
def test_a_corrupt_file_is_warned_about_once_and_ignored(tmp_path, caplog, content):
    path = tmp_path / "c.json"
    path.write_bytes(content.encode("latin-1"))
    b = Bench()
    sel = b.selector(path, write_cache=False)
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert sel.choose(KEY, b.candidates(triton=0.002, torch=0.001)) == "torch"
        assert sel.choose(KEY + "2", b.candidates(triton=0.001, torch=0.002)) == "triton"
    assert b.calls  # timed despite the file
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert path.read_bytes() == content.encode("latin-1")  # write disabled: left as it was


def test_a_corrupt_file_is_replaced_when_writing(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{truncated")
    b = Bench()
    b.selector(path).choose(KEY, b.candidates(triton=0.002, torch=0.001))
    assert json.loads(path.read_text())[KEY]["impl"] == "torch"


def test_write_disabled_writes_nothing(tmp_path, caplog):
    b = Bench()
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert b.selector(tmp_path / "c.json", write_cache=False).choose(KEY, b.candidates(triton=0.001)) == "triton"
        assert b.selector(tmp_path / "d.json").choose(KEY, b.candidates(torch=0.001), write=False) == "torch"
    assert list(tmp_path.iterdir()) == []
    assert sum("write disabled" in r.getMessage() for r in caplog.records) == 2
    b.selector(tmp_path / "e.json", write_cache=False).choose(KEY, b.candidates(torch=0.001), write=True)
    assert (tmp_path / "e.json").exists()  # the per-call flag wins


def test_an_unwritable_cache_is_warned_about_once_not_raised(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(S.os, "replace", _read_only_replace)
    b = Bench()
    sel = b.selector(tmp_path / "c.json")
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert sel.choose(KEY, b.candidates(triton=0.001, torch=0.002)) == "triton"
        assert sel.choose(KEY + "2", b.candidates(triton=0.002, torch=0.001)) == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write" in warnings[0] and "Read-only" in warnings[0]
    assert sum("not cached: the file cannot be written" in r.getMessage() for r in caplog.records) == 2
    assert list(tmp_path.iterdir()) == []  # the temp files are removed


def test_a_file_where_the_folder_should_be(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    b = Bench()
    sel = b.selector(blocker / "c.json")
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert sel.choose(KEY, b.candidates(triton=0.001, torch=0.002)) == "triton"
        assert sel.choose(KEY + "2", b.candidates(triton=0.002, torch=0.001)) == "torch"
    warnings = sorted(r.getMessage()[:12] for r in caplog.records if r.levelno == logging.WARNING)
    assert warnings == ["cannot write", "ignoring the"]  # reading and writing: each warned once


# ---------------------------------------------------------------------- two ranks
def test_ranks_follow_rank_0s_timing_when_their_fastest_differs(tmp_path):
    b0, b1 = Bench(), Bench()
    rec0, rec1 = [], []
    cands0 = b0.candidates(triton=0.001, gemm=0.002, torch=0.003)
    name0 = b0.selector(tmp_path / "r0.json").choose(KEY, cands0, agree=_rank0_agree(rec0))
    sel1 = b1.selector(tmp_path / "r1.json", write_cache=False)
    cands1 = b1.candidates(triton=0.003, gemm=0.001, torch=0.002)
    name1 = sel1.choose(KEY, cands1, agree=_follower_agree(rec0, rec1))
    assert name0 == name1 == "triton"
    assert sel1.timings[KEY]["gemm"] < sel1.timings[KEY]["triton"]  # its own fastest was gemm
    assert rec0 == [-1, 0] and rec1 == [-1, 1] and len(rec0) == len(rec1)
    assert not (tmp_path / "r1.json").exists()
    assert json.loads((tmp_path / "r0.json").read_text())[KEY]["impl"] == "triton"


def test_a_cache_on_rank_1_only_still_times_on_both(tmp_path):
    (tmp_path / "r1.json").write_text(json.dumps({KEY: {"impl": "torch", "times_ms": {}, "when": "x"}}))
    b0, b1 = Bench(), Bench()
    rec0, rec1 = [], []
    cands0 = b0.candidates(triton=0.001, gemm=0.002, torch=0.003)
    name0 = b0.selector(tmp_path / "r0.json").choose(KEY, cands0, agree=_rank0_agree(rec0))
    name1 = b1.selector(tmp_path / "r1.json", write_cache=False).choose(
        KEY, b1.candidates(triton=0.002, gemm=0.003, torch=0.001), agree=_follower_agree(rec0, rec1)
    )
    assert name0 == name1 == "triton"
    assert b0.calls and b1.calls  # both timed
    assert rec1 == [2, 2] and len(rec0) == len(rec1) == 2


def test_rank_0s_cache_is_used_everywhere_without_timing(tmp_path, caplog):
    (tmp_path / "r0.json").write_text(json.dumps({KEY: {"impl": "gemm", "times_ms": {}, "when": "x"}}))
    (tmp_path / "r1.json").write_text(json.dumps({KEY: {"impl": "torch", "times_ms": {}, "when": "x"}}))
    b0, b1 = Bench(), Bench()
    rec0, rec1 = [], []
    cands0 = b0.candidates(triton=0.001, gemm=0.002, torch=0.003)
    name0 = b0.selector(tmp_path / "r0.json").choose(KEY, cands0, agree=_rank0_agree(rec0))
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        name1 = b1.selector(tmp_path / "r2-missing.json").choose(
            KEY, b1.candidates(triton=0.001, gemm=0.002, torch=0.003), agree=_follower_agree(rec0, rec1)
        )
    assert name0 == name1 == "gemm"
    assert b0.calls == b1.calls == [] and rec0 == [1] and rec1 == [-1]
    assert any("rank 0's cached choice" in r.getMessage() for r in caplog.records)


def test_a_failure_on_rank_0_alone_makes_every_rank_raise(tmp_path):
    b0, b1 = Bench(), Bench()
    rec0, rec1 = [], []
    with pytest.raises(RuntimeError, match="on rank 0.*triton: RuntimeError: oom"):
        b0.selector(tmp_path / "r0.json").choose(KEY, b0.candidates(triton=RuntimeError("oom")), agree=_rank0_agree(rec0))
    with pytest.raises(RuntimeError, match="on rank 0"):
        b1.selector(tmp_path / "r1.json").choose(KEY, b1.candidates(triton=0.001), agree=_follower_agree(rec0, rec1))
    assert len(rec0) == len(rec1) == 2


def test_rank_0s_pick_that_failed_here_is_followed_with_a_warning(tmp_path, caplog):
    b0, b1 = Bench(), Bench()
    rec0, rec1 = [], []
    b0.selector(tmp_path / "r0.json").choose(KEY, b0.candidates(triton=0.001, torch=0.002), agree=_rank0_agree(rec0))
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        name = b1.selector(tmp_path / "r1.json").choose(
            KEY, b1.candidates(triton=RuntimeError("oom"), torch=0.002), agree=_follower_agree(rec0, rec1)
        )
    assert name == "triton"
    assert any(r.levelno == logging.WARNING and "rank 0 chose triton" in r.getMessage() for r in caplog.records)


def test_agree_returning_nonsense_is_an_error(tmp_path):
    b = Bench()
    with pytest.raises(RuntimeError, match="agree"):
        b.selector(tmp_path / "c.json").choose(KEY, b.candidates(triton=0.001), agree=lambda i: 5)


# ---------------------------------------------------------------------- helpers
def test_env_override(monkeypatch):
    assert S.env_override() is None
    monkeypatch.setenv(S.ENV_VAR, "")
    assert S.env_override() is None
    for name in ("triton", "gemm", "torch", "auto"):
        monkeypatch.setenv(S.ENV_VAR, name)
        assert S.env_override() == name
    monkeypatch.setenv(S.ENV_VAR, " Gemm ")
    assert S.env_override() == "gemm"
    monkeypatch.setenv(S.ENV_VAR, "cudnn")
    with pytest.raises(ValueError) as info:
        S.env_override()
    assert "SHARDFC_HEAD_IMPL" in str(info.value) and "'cudnn'" in str(info.value)
    assert all(name in str(info.value) for name in ("triton", "gemm", "torch"))


def test_cache_file_locations(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFC_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert S.cache_file() == tmp_path / "mine" / "head_impl.json"
    monkeypatch.setenv("SHARDFC_CACHE_DIR", "")
    assert S.cache_file() == tmp_path / "xdg" / "shardfc" / "head_impl.json"
    monkeypatch.delenv("SHARDFC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert S.cache_file() == tmp_path / "home" / ".cache" / "shardfc" / "head_impl.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert S.cache_file() == tmp_path / "home" / ".cache" / "shardfc" / "head_impl.json"
    assert S.ImplSelector().path == S.cache_file()


def test_bucket_and_workload_key():
    assert [S.bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000)] == [0, 1, 2, 4, 4, 8, 1024]
    assert S.bucket(1_000_000) == S.bucket(1_000_003) == 2**20
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        S.bucket(-1)
    a = S.workload_key(classes=S.bucket(1_000_000), dtype=torch.float16, arcface=True, gpu="H100")
    b = S.workload_key(gpu="H100", arcface=True, dtype=torch.float16, classes=S.bucket(1_000_003))
    assert a == b and "torch.float16" in a
    assert a != S.workload_key(classes=S.bucket(1_000_000), dtype=torch.bfloat16, arcface=True, gpu="H100")
    assert len(S.short_key(a)) == 10 and S.short_key(a) == S.short_key(b)
    fields = S.environment_fields("cpu")
    assert fields["gpu"] == "cpu" and fields["torch"] == torch.__version__
    assert S.workload_key(**fields)  # JSON-able


def test_default_selector_is_created_once(tmp_path):
    sel = S.default_selector()
    assert sel is S.default_selector()
    assert sel.path == tmp_path / "default-cache" / "head_impl.json"
    assert sel.write_cache and sel.steps == 5 and sel.warmup == 1


# ---------------------------------------------------------------------- the ranks' agreement
def _gathers(*views):
    """One fake all-gather per rank: each returns every rank's code, as the head's all-reduce does,
    and records that it was called (the collective every rank must enter)."""
    codes = [v.encode() for v in views]
    calls = []

    def gather(code):
        assert code in codes  # what this rank sent is its own view's code
        calls.append(code)
        return list(codes)

    return gather, calls


def test_rank_views_round_trip_through_their_codes():
    seen = set()
    for override in (None, "triton", "gemm", "torch", S.INVALID):
        for runs in (False, True):
            for cached in range(-1, len(S.NAMES)):
                view = S.RankView(override, runs, cached)
                code = view.encode()
                assert 0 <= code < S.VIEW_CODES and S.RankView.decode(code) == view
                seen.add(code)
    assert len(seen) == S.VIEW_CODES  # one code per view, none shared
    for bad in (-1, S.VIEW_CODES, 2.0, True):
        with pytest.raises(RuntimeError, match="not the code of a head-impl view"):
            S.RankView.decode(bad)
    with pytest.raises(ValueError, match="override must be one of"):
        S.RankView("cuda")
    with pytest.raises(ValueError, match="cached must be an index"):
        S.RankView(None, True, len(S.NAMES))


def test_an_override_on_some_ranks_only_is_one_error_naming_them():
    views = [S.RankView(), S.RankView("gemm")]
    with pytest.raises(ValueError) as info:
        S.settle_views(views)
    assert str(info.value) == (
        "SHARDFC_HEAD_IMPL differs across ranks: rank 0 unset, rank 1 'gemm'; set it on every rank or on none"
    )
    # many ranks: runs of ranks as ranges, one line whatever the world size
    views = [S.RankView()] * 8 + [S.RankView("torch"), S.RankView("gemm")] + [S.RankView("torch")] * 2
    with pytest.raises(ValueError, match=r"ranks 0-7 unset, ranks 8,10-11 'torch', rank 9 'gemm'; set it"):
        S.settle_views(views)


def test_an_invalid_override_anywhere_is_an_error_everywhere():
    with pytest.raises(ValueError, match=r"SHARDFC_HEAD_IMPL names no implementation of the head on rank 1 .*triton, gemm, torch"):
        S.settle_views([S.RankView(), S.RankView(S.INVALID, False)])


def test_an_override_that_cannot_run_on_some_rank_is_an_error_everywhere():
    with pytest.raises(ValueError, match=r"SHARDFC_HEAD_IMPL='triton' cannot run on ranks 1-2 \(see the error there\)"):
        S.settle_views([S.RankView("triton"), S.RankView("triton", False), S.RankView("triton", False)])


def test_what_the_ranks_settle_on():
    assert S.settle_views([S.RankView("gemm", cached=0)] * 3) == S.Settled("gemm", "override")
    # no override, the fused kernels cannot run on rank 1: torch everywhere, rank 1 named
    assert S.settle_views([S.RankView(cached=0), S.RankView(None, False)]) == S.Settled("torch", "no-triton", (1,))
    assert S.settle_views([S.RankView(None, False)] * 2) == S.Settled("torch", "no-triton", (0, 1))
    # else rank 0's cache entry, whatever the others' say; else time
    assert S.settle_views([S.RankView(cached=1), S.RankView(cached=2)]) == S.Settled("gemm", "cached")
    assert S.settle_views([S.RankView(), S.RankView(cached=2)]) == S.Settled(None, "time")
    with pytest.raises(ValueError, match="at least one rank"):
        S.settle_views([])


def test_settle_costs_one_collective_per_workload_and_remembers(tmp_path, caplog):
    (tmp_path / "r0.json").write_text(json.dumps({KEY: {"impl": "gemm", "times_ms": {}, "when": "x"}}))
    sel0, sel1 = S.ImplSelector(tmp_path / "r0.json"), S.ImplSelector(tmp_path / "r1.json")
    gather, calls = _gathers(S.RankView(cached=1), S.RankView())
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert sel0.settle(KEY, None, True, gather) == "gemm"
        assert sel1.settle(KEY, None, True, gather) == "gemm"
    assert len(calls) == 2 and sel0.choices[KEY] == sel1.choices[KEY] == "gemm"
    assert any("rank 0's cached choice" in r.getMessage() for r in caplog.records)
    # the next forwards of the workload: no collective
    assert sel0.settle(KEY, None, True, lambda c: pytest.fail("no collective on a memory hit")) == "gemm"


def test_settle_leaves_the_timing_to_choose_without_a_second_cache_agreement(tmp_path):
    gather, calls = _gathers(S.RankView(), S.RankView())
    sel = S.ImplSelector(tmp_path / "c.json")
    assert sel.settle(KEY, None, True, gather) is None and KEY not in sel.choices
    b = Bench()
    record = []
    name = b.selector(tmp_path / "c.json").choose(
        KEY, b.candidates(triton=0.002, gemm=0.001), agree=_rank0_agree(record), cached=False
    )
    assert name == "gemm" and record == [1]  # one collective: the fastest, none for the cache


def test_settle_raises_from_this_ranks_own_error(tmp_path):
    here = ValueError("SHARDFC_HEAD_IMPL='cudnn' is not an implementation of the head")
    gather, _ = _gathers(S.RankView(S.INVALID, False), S.RankView())
    with pytest.raises(ValueError, match="names no implementation of the head on rank 0") as info:
        S.ImplSelector(tmp_path / "c.json").settle(KEY, S.INVALID, False, gather, cause=here)
    assert info.value.__cause__ is here
    with pytest.raises(ValueError, match="on rank 0") as info:  # rank 1's error has no cause of its own
        S.ImplSelector(tmp_path / "c.json").settle(KEY, None, True, gather)
    assert info.value.__cause__ is None
    assert not (tmp_path / "c.json").exists()


def test_torch_everywhere_when_the_fused_kernels_cannot_run_on_some_rank(tmp_path, caplog):
    gather, _ = _gathers(S.RankView(), S.RankView(None, False))
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert S.ImplSelector(tmp_path / "c.json").settle(KEY, None, True, gather) == "torch"
        why = RuntimeError("Triton is not installed")
        assert S.ImplSelector(tmp_path / "d.json").settle(KEY, None, False, gather, cause=why) == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("torch on every rank" in w and "on rank 1" in w for w in warnings)
    assert "here: Triton is not installed" in warnings[1]
    caplog.clear()
    gather, _ = _gathers(S.RankView(None, False), S.RankView(None, False))  # a CPU run: nothing to warn about
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert S.ImplSelector(tmp_path / "e.json").settle(KEY, None, False, gather) == "torch"
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


# ---------------------------------------------------------------------- the head's workload key
def test_the_heads_workload_key_holds_what_can_change_the_choice(monkeypatch):
    import shardfc
    from shardfc.head import module as M

    def key(sample_rate=0.5, sparse_grad=False, sampling=True, device="cpu", **kw):
        head = shardfc.ShardedMarginHead(8, 37, sample_rate=sample_rate, sparse_grad=sparse_grad)
        return M.workload_key(head, 6, torch.float32, torch.float32, torch.device(device), sampling, **kw)

    base = key()
    fields = json.loads(base)
    for name in ("shardfc", "torch", "triton", "cuda", "gpu", "sample_rate", "sparse_grad", "fused_update"):
        assert name in fields, name
    assert fields["fused_update"] is False and fields["shardfc"] == shardfc.__version__
    assert key(sample_rate=0.25) != base
    assert key(sparse_grad=True) != base
    assert key(fused_update=True) != base
    # a dense forward (evaluation) does the same work whatever the training's sampling says
    assert key(sample_rate=0.25, sampling=False) == key(sampling=False) != base
    for module, attr, value in ((shardfc.version, "__version__", "99.0"), (torch, "__version__", "99.0+stub")):
        with monkeypatch.context() as m:
            m.setattr(module, attr, value)
            assert key() != base, attr
    with monkeypatch.context() as m:
        m.setattr(S, "_triton_version", lambda: "99.0")
        assert key() != base
    with monkeypatch.context() as m:
        names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
        m.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
        assert key(device="cuda") != key(device="cuda")
    with pytest.raises(TypeError, match="fused_update must be True or False, got 'yes'"):
        key(fused_update="yes")
    with pytest.raises(TypeError, match="sampling must be True or False, got 1"):
        key(sampling=1)


def test_the_heads_workload_key_tells_apart_every_workload_the_choice_may_differ_on():
    import shardfc
    from shardfc import margins as margins_
    from shardfc.head import module as M

    def key(batch=6, compute=torch.float32, weights=torch.float32, **head_kw):
        kw = dict(embedding_dim=8, num_classes=37)
        kw.update(head_kw)
        head = shardfc.ShardedMarginHead(**kw)
        return M.workload_key(head, batch, compute, weights, torch.device("cpu"), True)

    base = key()
    variants = {
        "compute dtype": key(compute=torch.bfloat16),
        "compute fp16": key(compute=torch.float16),
        "weight dtype": key(weights=torch.bfloat16),
        "batch": key(batch=12),
        "classes": key(num_classes=100),
        "dim": key(embedding_dim=16),
        "subcenters": key(subcenters=2),
        "margin": key(margin=margins_.CosFace(64.0, 0.35)),
        "label smoothing": key(label_smoothing=0.1),
        "inter-class filter": key(interclass_filter_threshold=0.3),
        "shards": key(devices=["cpu", "cpu"]),
        "chunk scale": key(gpu_chunk_scale=4),
    }
    assert [name for name, k in variants.items() if k == base] == []
    assert len(set(variants.values())) == len(variants)
    # counts are bucketed to powers of two: batches of 5..8 and 33..64 classes are one workload
    assert key(batch=5) == key(batch=8) == base and key(num_classes=64) == base != key(num_classes=65)


def test_the_heads_workload_key_fields_say_what_they_name():
    import shardfc
    from shardfc import margins as margins_
    from shardfc.head import module as M

    def fields(sampling=True, world=None, **head_kw):
        head = shardfc.ShardedMarginHead(8, 37, **head_kw)
        if world is not None:
            head.world_size = world  # what a rank of that many reads (the key is a function of the head's fields)
        return json.loads(M.workload_key(head, 6, torch.float32, torch.float32, torch.device("cpu"), sampling))

    plain = fields()
    assert (plain["normalize"], plain["needs_norm"], plain["filter"], plain["smoothing"]) == (True, False, False, False)
    assert (plain["world"], plain["shards"], plain["chunk_scale"], plain["sample_rate"]) == (1, 1, None, 1.0)
    assert fields(margin=margins_.Softmax())["normalize"] is False
    assert fields(margin=margins_.SphereFace(4))["needs_norm"] is True
    assert fields(interclass_filter_threshold=0.3)["filter"] is True
    assert fields(world=4)["world"] == 4 and fields(gpu_chunk_scale=2)["chunk_scale"] == 2
    assert fields(sample_rate=0.3, sampling=False)["sample_rate"] == 1.0  # a dense forward's work
    assert fields(sample_rate=0.3)["sample_rate"] == 0.3


def test_a_cached_choice_at_a_chunk_scale_is_what_the_ranks_settle_on(tmp_path):
    """A cache entry names an implementation at a chunk scale (what ``impl="auto"`` times): the
    ranks settle on it by its index in ``NAMES``, and an entry that names neither is no entry."""
    path = tmp_path / "head_impl.json"
    path.write_text(json.dumps({"k": {"impl": "gemm@4"}, "old": {"impl": "gemm@3"}}))
    selector = S.ImplSelector(path=path, sync=lambda: None)
    assert selector.settle("k", None, True) == "gemm@4"
    assert selector.settle("old", None, True) is None  # not a name a choice can have: time anew


# ---------------------------------------------------------------------- exact texts and edges (mutation testing)
def _messages(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_the_timing_table_reads_whole(tmp_path, caplog):
    """The table, line by line: each candidate's median or failure, the chosen one, the fastest
    here when rank 0 picked another, and where the choice went."""
    b = Bench()
    path = tmp_path / "c.json"
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        b.selector(path, steps=3, warmup=2).choose(
            KEY, b.candidates(triton=RuntimeError("boom"), gemm=0.0025, torch=0.00125))
    short = S.short_key(KEY)
    assert _messages(caplog) == [
        f"head impl for workload {short} (median of 3 calls after 2 warm-up; cached in {path}):\n"
        "  triton  failed: RuntimeError: boom\n"
        "  gemm         2.500 ms\n"
        "  torch        1.250 ms  chosen"
    ]
    caplog.clear()
    b1, rec = Bench(), []
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        b1.selector(tmp_path / "d.json", steps=1, warmup=0, write_cache=False).choose(
            KEY, b1.candidates(gemm=0.002, torch=0.001), agree=_follower_agree([-1, 0], rec))
    assert _messages(caplog) == [
        f"head impl for workload {short} (median of 1 calls after 0 warm-up; not cached here (write disabled)):\n"
        "  gemm         2.000 ms  chosen (rank 0's pick)\n"
        "  torch        1.000 ms  fastest here"
    ]
    caplog.clear()
    b2 = Bench()
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        b2.selector(tmp_path / "e.json", steps=1, warmup=0, write_cache=False).choose(
            KEY, b2.candidates(gemm=RuntimeError("oom"), torch=0.001), agree=_follower_agree([-1, 0], []))
    assert _messages(caplog, logging.WARNING) == [
        f"head impl for workload {short}: rank 0 chose gemm, which failed here (RuntimeError: oom)"
    ]


def test_what_no_candidate_running_says_here_and_on_rank_0(tmp_path):
    short = S.short_key(KEY)
    b = Bench()
    with pytest.raises(RuntimeError) as info:
        b.selector(tmp_path / "c.json").choose(KEY, b.candidates(gemm=RuntimeError("a"), torch=ValueError("b")))
    assert str(info.value) == (
        f"no implementation of the head could run here (workload {short}): gemm: RuntimeError: a; torch: ValueError: b"
    )
    with pytest.raises(RuntimeError) as info:  # rank 0 failed, this rank did not
        b.selector(tmp_path / "d.json").choose(KEY, b.candidates(torch=0.001), agree=lambda i: -1)
    assert str(info.value) == (
        f"no implementation of the head could run on rank 0 (workload {short}): none failed here"
    )
    with pytest.raises(RuntimeError) as info:  # rank 0 has no cache entry and picks one that fails here
        b.selector(tmp_path / "e.json").choose(
            KEY, b.candidates(torch=RuntimeError("c")), agree=_follower_agree([-1, 0], []))
    assert "could run here" in str(info.value)


def test_a_cached_first_candidate_is_a_choice_and_logged_as_cached(tmp_path, caplog):
    """Index 0 of the candidates is a cache hit like any other (not "no entry")."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({KEY: {"impl": "triton", "times_ms": {}, "when": "x"}}))
    b = Bench()
    sel = b.selector(path)
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert sel.choose(KEY, b.candidates(triton=0.002, torch=0.001)) == "triton"
    assert b.calls == [] and sel.choices == {KEY: "triton"}
    assert _messages(caplog) == [f"head impl for workload {S.short_key(KEY)}: triton (cached in {path})"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        sel1 = b.selector(tmp_path / "none.json")
        assert sel1.choose(KEY, b.candidates(triton=0.002, torch=0.001), agree=lambda i: 0) == "triton"
    assert b.calls == [] and sel1.choices == {KEY: "triton"}
    assert _messages(caplog) == [f"head impl for workload {S.short_key(KEY)}: triton (rank 0's cached choice)"]


def test_agree_may_return_minus_one_to_n_minus_one_only(tmp_path):
    b = Bench()
    for bad in (-2, 2):
        with pytest.raises(RuntimeError) as info:
            b.selector(tmp_path / "c.json").choose(KEY, b.candidates(gemm=0.001, torch=0.002), agree=lambda i: bad)
        assert str(info.value) == f"agree(-1) returned {bad}, not an index of the 2 candidates or -1"
    assert b.selector(tmp_path / "d.json").choose(KEY, b.candidates(gemm=0.002, torch=0.001), agree=lambda i: 1) == "torch"


def test_only_out_of_memory_on_a_cuda_machine_empties_the_cache(tmp_path, monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b = Bench()
    b.selector(tmp_path / "c.json").choose(KEY, b.candidates(triton=torch.cuda.OutOfMemoryError("oom"), torch=0.001))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    b.selector(tmp_path / "d.json").choose(KEY, b.candidates(triton=RuntimeError("not oom"), torch=0.001))
    assert emptied == []


def test_the_selectors_defaults_and_argument_names(tmp_path, monkeypatch):
    import time

    sel = S.ImplSelector(tmp_path / "c.json")
    assert sel.clock is time.perf_counter and sel.log is logging.getLogger("shardfc.head")
    assert sel.sync() is None  # nothing to wait for without CUDA
    mine = logging.getLogger("mine")
    assert S.ImplSelector(tmp_path / "c.json", log=mine).log is mine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert S.ImplSelector(tmp_path / "c.json").sync is torch.cuda.synchronize
    with pytest.raises(ValueError) as info:
        S.ImplSelector(tmp_path / "c.json", steps=0)
    assert str(info.value).startswith("steps must be")
    with pytest.raises(ValueError) as info:
        S.ImplSelector(tmp_path / "c.json", warmup=-1)
    assert str(info.value).startswith("warmup must be")


def test_the_cache_file_is_indented_sorted_json_written_beside_itself(tmp_path, monkeypatch):
    """One entry per workload, sorted and indented (a person reads it), written to a temporary
    file in the same folder and renamed (a rename across file systems would not be atomic)."""
    made = []
    real = S.tempfile.mkstemp

    def spy(**kw):
        made.append(kw)
        return real(**kw)

    monkeypatch.setattr(S.tempfile, "mkstemp", spy)
    path = tmp_path / "c.json"
    b = Bench()
    b.selector(path).choose(KEY, b.candidates(torch=0.00112345678, gemm=RuntimeError("x")))
    text = path.read_text(encoding="utf-8")
    data = json.loads(text)
    assert text == json.dumps(data, indent=1, sort_keys=True) + "\n"
    assert data[KEY]["times_ms"] == {"gemm": None, "torch": 1.1235}  # four decimals
    assert made == [{"dir": tmp_path, "prefix": ".c.json.", "suffix": ".tmp"}]


def test_what_each_unreadable_cache_says(tmp_path, caplog, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="shardfc.head"):
        assert S.ImplSelector(path)._read() == {}
    [refused] = _messages(caplog, logging.WARNING)
    assert refused.startswith(f"ignoring the head-impl cache (head-impl cache {path} ")
    assert refused.endswith("); its workloads are timed again")
    caplog.clear()
    path.write_text("[1, 2]")
    with caplog.at_level(logging.WARNING, logger="shardfc.head"):
        assert S.ImplSelector(path)._read() == {}
    assert _messages(caplog, logging.WARNING) == [f"ignoring the head-impl cache {path}: not a JSON object"]
    caplog.clear()

    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(S.files, "load_json", unreadable)
    sel = S.ImplSelector(path)
    with caplog.at_level(logging.WARNING, logger="shardfc.head"):
        assert sel._read() == {} and sel._read() == {}
    assert _messages(caplog, logging.WARNING) == [
        f"ignoring the head-impl cache {path}: PermissionError: [Errno 13] Permission denied"
    ]


def test_a_reason_is_one_line_of_at_most_200_characters():
    assert S._reason(RuntimeError("first\nsecond")) == "RuntimeError: first"
    assert S._reason(RuntimeError("  padded  ")) == "RuntimeError: padded"
    assert S._reason(KeyError()) == "KeyError"
    assert S._reason(RuntimeError("\n")) == "RuntimeError"
    assert S._reason(RuntimeError("MAX")) == "RuntimeError: MAX"  # only the separator is stripped
    exact = "x" * (200 - len("RuntimeError: "))
    assert S._reason(RuntimeError(exact)) == f"RuntimeError: {exact}"
    long = S._reason(RuntimeError(exact + "y"))
    assert len(long) == 200 and long == f"RuntimeError: {exact[:-3]}..."


def test_exact_texts_of_the_small_helpers(monkeypatch):
    monkeypatch.setenv(S.ENV_VAR, "cudnn")
    with pytest.raises(ValueError) as info:
        S.env_override()
    assert str(info.value) == (
        f"SHARDFC_HEAD_IMPL='cudnn' is not an implementation of the head; choose from {', '.join(S.IMPLS)}"
    )
    with pytest.raises(ValueError) as info:
        S.workload_key()
    assert str(info.value) == "workload_key needs at least one field"
    assert S.workload_key(b=torch.float32, a=1) == '{"a":1,"b":"torch.float32"}'
    with pytest.raises(ValueError) as info:
        S.settle_views([])
    assert str(info.value) == "settle_views needs the view of at least one rank"
    with pytest.raises(RuntimeError) as info:
        S.RankView.decode(S.VIEW_CODES)
    assert str(info.value) == f"a rank sent {S.VIEW_CODES}, not the code of a head-impl view (0 .. {S.VIEW_CODES - 1})"
    with pytest.raises(ValueError, match="cached must be an index"):
        S.RankView(None, True, -2)
    assert S.settle_views([S.RankView(cached=0)]) == S.Settled(S.NAMES[0], "cached")


def test_the_machine_fields_name_the_cuda_device_when_none_is_given(monkeypatch):
    assert S.environment_fields()["gpu"] == "cpu"  # no CUDA here
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or "NVIDIA H200")
    assert S.environment_fields()["gpu"] == "NVIDIA H200"
    assert S.environment_fields("cuda:1")["gpu"] == "NVIDIA H200"
    assert S.environment_fields("cpu")["gpu"] == "cpu"  # a CPU head on a CUDA machine
    assert asked == [torch.device("cuda"), torch.device("cuda:1")]


def test_settle_messages_and_what_it_reads(tmp_path, caplog, monkeypatch):
    short = S.short_key(KEY)
    path = tmp_path / "r0.json"
    path.write_text(json.dumps({KEY: {"impl": "gemm", "times_ms": {}, "when": "x"}}))
    with caplog.at_level(logging.DEBUG, logger="shardfc.head"):
        assert S.ImplSelector(path).settle(KEY, None, True) == "gemm"
        gather, _ = _gathers(S.RankView("torch"), S.RankView("torch"))
        assert S.ImplSelector(path).settle(KEY, "torch", True, gather) == "torch"
        gather, _ = _gathers(S.RankView(None, False), S.RankView(None, False))
        assert S.ImplSelector(path).settle(KEY, None, False, gather) == "torch"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"head impl for workload {short}: gemm (cached in {path})"),
        (logging.INFO, f"head impl for workload {short}: torch (SHARDFC_HEAD_IMPL on every rank)"),
        (logging.DEBUG, f"head impl for workload {short}: torch (the fused kernels run on no rank)"),
    ]
    caplog.clear()
    gather, _ = _gathers(S.RankView(cached=1), S.RankView())  # rank 0's entry, none here
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        assert S.ImplSelector(tmp_path / "none.json").settle(KEY, None, True, gather) == "gemm"
    assert _messages(caplog) == [f"head impl for workload {short}: gemm (rank 0's cached choice)"]
    caplog.clear()
    gather, _ = _gathers(S.RankView(), S.RankView(None, False))
    why = RuntimeError("Triton is not installed")
    with caplog.at_level(logging.INFO, logger="shardfc.head"):  # a rank that could run them: no "here"
        assert S.ImplSelector(tmp_path / "x.json").settle(KEY, None, True, gather, cause=why) == "torch"
    assert _messages(caplog, logging.WARNING) == [
        f"head impl for workload {short}: torch on every rank, as the fused kernels cannot run on rank 1 and every "
        "rank runs the same implementation; make Triton run there (a CUDA device, pip install 'shardfc[gpu]') or "
        "pass impl='torch' to choose torch yourself"
    ]
    # an override, or a rank that cannot time the candidates, never reads the cache file
    monkeypatch.setattr(S.ImplSelector, "_read", lambda self: pytest.fail("the cache was read"))
    assert S.ImplSelector(path).settle(KEY, "gemm", True) == "gemm"
    assert S.ImplSelector(path).settle(KEY, None, False) == "torch"


def test_an_error_about_another_ranks_override_has_no_cause_here(tmp_path):
    """``cause`` explains this rank's own override; an error about another rank's is not from it."""
    gather, _ = _gathers(S.RankView(), S.RankView("gemm"))
    why = RuntimeError("Triton is not installed")
    with pytest.raises(ValueError, match="differs across ranks") as info:
        S.ImplSelector(tmp_path / "c.json").settle(KEY, None, True, gather, cause=why)
    assert info.value.__cause__ is None


def test_the_table_says_when_the_choice_could_not_be_cached(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(S.os, "replace", _read_only_replace)
    b = Bench()
    with caplog.at_level(logging.INFO, logger="shardfc.head"):
        b.selector(tmp_path / "c.json", steps=1, warmup=0).choose(KEY, b.candidates(torch=0.001))
    assert _messages(caplog)[0] == (
        f"head impl for workload {S.short_key(KEY)} (median of 1 calls after 0 warm-up; "
        "not cached: the file cannot be written):\n  torch        1.000 ms  chosen"
    )
