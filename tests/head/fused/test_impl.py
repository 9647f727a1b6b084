"""Which implementation a head runs, and the errors that say why Triton cannot."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from fused_pairs import DEVICE

import shardfc
from shardfc.head import impl_select
from shardfc.head.fused import TIMED


def _step(head, D=8):
    """One forward on the head's device (the CPU, or the GPU of a CUDA machine)."""
    x, y = torch.randn(4, D), torch.tensor([0, 1, 2, 3])
    return head(x.to(head.weight.device), y.to(head.weight.device))


def test_bad_impl_name():
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'triton', 'gemm', 'torch'\), got 'cuda'"):
        shardfc.ShardedMarginHead(8, 10, impl="cuda")


def test_auto_is_torch_on_the_cpu_even_under_the_interpreter():
    head = shardfc.ShardedMarginHead(8, 10)
    _step(head)
    assert head.impl == "auto" and head.last_impl == "torch"


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_gpu_impls_on_cpu_without_interpreter(monkeypatch, impl):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    head = shardfc.ShardedMarginHead(8, 10, impl=impl)
    with pytest.raises(ValueError, match=rf"impl='{impl}' cannot run: the head's tensors are on cpu, not a CUDA device"):
        _step(head)


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_gpu_impls_with_float64(impl):
    head = shardfc.ShardedMarginHead(8, 10, impl=impl, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=r"fp32 statistics; inputs of torch.float64 need impl='torch'"):
        _step(head)


@pytest.mark.parametrize("impl", ["triton", "gemm"])
def test_wide_embeddings_run(impl):
    """No ``[tile, D]`` accumulator is left in any kernel: D above the old limit of 1024 runs,
    and equals the torch path."""
    D = 1100
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, D, generator=g), torch.tensor([0, 1, 2, 3, 4, 5])
    out = {}
    for name in ("torch", impl):
        head = shardfc.ShardedMarginHead(D, 10, impl=name, device=DEVICE)
        xr = x.to(DEVICE, copy=True).requires_grad_()
        head(xr, y.to(DEVICE)).backward()
        out[name] = (xr.grad.cpu(), head.weight.grad.cpu())
    for got, ref in zip(out[impl], out["torch"]):
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_triton_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    head = shardfc.ShardedMarginHead(8, 10, impl="triton")
    with pytest.raises(ValueError, match=r"Triton is not installed \(pip install 'shardfc\[gpu\]'\)"):
        _step(head)
    auto = shardfc.ShardedMarginHead(8, 10)
    _step(auto)
    assert auto.last_impl == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_times_the_candidates_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv(impl_select.CACHE_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(impl_select, "default_selector", lambda s=impl_select.ImplSelector(): s)
    head = shardfc.ShardedMarginHead(8, 10, device="cuda")
    head(torch.randn(4, 8, device="cuda"), torch.tensor([0, 1, 2, 3], device="cuda"))
    assert head.last_impl in ("triton", "gemm", "torch")
    assert (tmp_path / impl_select.CACHE_NAME).exists()


def test_an_impl_error_changes_no_state(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    head = shardfc.ShardedMarginHead(8, 10, impl="triton", sample_rate=0.5)
    with pytest.raises(ValueError, match="impl='triton' cannot run"):
        _step(head)
    assert head.sample_step == 0 and head.sampled_rows is None


# ------------------------------------------------------------------ impl="auto" on a GPU, simulated
#: Timed calls per candidate: two, so a candidate runs three times (its warm-up, two timed) and one
#: that changed state would be caught; each is a step under the interpreter, the file's main cost.
STEPS = 2


class _Clock:
    """A stub clock: each timed call of candidate ``k`` (in the order tried) lasts ``ms[k]``."""

    def __init__(self, ms, steps):
        self.ms, self.steps, self.calls, self.now = ms, steps, 0, 0.0

    def __call__(self):
        pair, end = divmod(self.calls, 2)
        self.calls += 1
        if end:
            self.now += self.ms[min(pair // self.steps, len(self.ms) - 1)] / 1000
        return self.now


@pytest.fixture
def auto_on_gpu(monkeypatch, tmp_path):
    """``impl="auto"`` as on a CUDA GPU (the candidates run under the interpreter here), with a
    selector whose clock says: triton 3 ms at every chunk scale, gemm 1.5, 1, 1.2 and 1.3 ms at
    scales 1, 2, 4 and 8, torch 2 ms (the order of ``TIMED``); a warm-up and STEPS timed calls each."""
    import shardfc.head.module as module

    real = module.resolve_impl
    monkeypatch.setattr(module, "resolve_impl", lambda impl, *a: "auto" if impl == "auto" else real(impl, *a))
    monkeypatch.delenv(impl_select.ENV_VAR, raising=False)
    clock = _Clock([3.0] * 4 + [1.5, 1.0, 1.2, 1.3, 2.0], steps=STEPS)
    selector = impl_select.ImplSelector(path=tmp_path / "head_impl.json", steps=STEPS, warmup=1, clock=clock,
                                        sync=lambda: None)
    monkeypatch.setattr(impl_select, "default_selector", lambda: selector)
    return selector, clock


def _trained(impl, **kw):
    torch.manual_seed(0)
    head = shardfc.ShardedMarginHead(8, 37, impl=impl, device=DEVICE, **kw)
    x, y = torch.randn(6, 8), torch.tensor([0, 5, 9, 36, 20, 1])
    xr = x.to(DEVICE).requires_grad_()
    loss = head(xr, y.to(DEVICE))
    loss.backward()
    return head, loss.detach(), xr.grad, head.weight.grad


@pytest.mark.parametrize("kw", [{}, {"sample_rate": 0.5}, {"subcenters": 2, "interclass_filter_threshold": 0.3}])
def test_auto_picks_the_fastest_and_changes_no_state(auto_on_gpu, kw):
    selector, clock = auto_on_gpu
    head, loss, gx, gw = _trained("auto", **kw)
    assert (head.last_impl, head.last_chunk_scale) == ("gemm", 2)
    assert len(selector.timings) == 1 and clock.calls == 2 * STEPS * 9  # 9 candidates x STEPS timed calls, a clock read at each end
    assert list(next(iter(selector.timings.values()))) == list(TIMED)  # each implementation at each scale
    # The timing runs left nothing behind: the step equals one run with impl="gemm" from the start
    # (same loss, same gradients, Partial FC's sample step advanced once).
    ref, ref_loss, ref_gx, ref_gw = _trained("gemm", gpu_chunk_scale=2, **kw)
    assert head.sample_step == ref.sample_step
    assert torch.equal(loss, ref_loss) and torch.equal(gx, ref_gx) and torch.equal(gw, ref_gw)
    # The choice is remembered: a second forward times nothing, and the cache file holds it ...
    head(torch.randn(5, 8, device=DEVICE), torch.tensor([1, 2, 3, 4, 5], device=DEVICE))  # the batch bucket of 6
    assert clock.calls == 2 * STEPS * 9 and head.last_impl == "gemm"
    # ... while a new workload (another batch bucket) is timed anew.
    _step(head, 8)
    assert clock.calls == 2 * 2 * STEPS * 9 and len(selector.timings) == 2
    first = next(iter(selector.timings))
    assert json.loads(selector.path.read_text())[first]["impl"] == "gemm@2"


def test_auto_times_only_the_chunk_scale_a_head_names(auto_on_gpu):
    selector, _ = auto_on_gpu
    # gemm fastest (the fixture's clock ties all three at 3 ms: the pick would be float rounding's)
    clock = selector.clock = _Clock([3.0, 1.0, 2.0], steps=STEPS)
    head, *_ = _trained("auto", gpu_chunk_scale=4)
    assert list(next(iter(selector.timings.values()))) == ["triton@4", "gemm@4", "torch"]
    assert clock.calls == 2 * STEPS * 3 and (head.last_impl, head.last_chunk_scale) == ("gemm", 4)


@pytest.mark.parametrize("bad", [0, 3, 16, True, "2", 2.0])
def test_a_chunk_scale_outside_the_list_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"gpu_chunk_scale must be None or one of \(1, 2, 4, 8\), got {re.escape(repr(bad))}"):
        shardfc.ShardedMarginHead(8, 37, gpu_chunk_scale=bad)


def test_auto_reads_the_cache_of_an_earlier_run(auto_on_gpu):
    selector, clock = auto_on_gpu
    _trained("auto")
    fresh = impl_select.ImplSelector(path=selector.path, clock=clock, sync=lambda: None)
    impl_select.default_selector = lambda: fresh  # monkeypatched by the fixture, restored after
    before = clock.calls
    head, *_ = _trained("auto")
    assert (head.last_impl, head.last_chunk_scale) == ("gemm", 2) and clock.calls == before


@pytest.mark.parametrize("name", ["torch", "gemm"])
def test_env_names_the_impl_of_auto_heads(auto_on_gpu, monkeypatch, name):
    selector, clock = auto_on_gpu
    monkeypatch.setenv(impl_select.ENV_VAR, name)
    head, *_ = _trained("auto")
    assert head.last_impl == name and clock.calls == 0
    explicit, *_ = _trained("triton")  # an explicit impl= wins over the variable
    assert explicit.last_impl == "triton"


def test_env_with_a_bad_value(monkeypatch):
    monkeypatch.setenv(impl_select.ENV_VAR, "cuda")
    head = shardfc.ShardedMarginHead(8, 10)
    with pytest.raises(ValueError, match=r"SHARDFC_HEAD_IMPL='cuda' is not an implementation"):
        _step(head)


@pytest.mark.parametrize("kw", [{}, {"sample_rate": 0.5}])
def test_auto_times_the_forward_in_the_real_shards_autotune_bucket(auto_on_gpu, monkeypatch, kw):
    """The timing's fused forward runs on the shard's own class count, so Triton's autotuner (keyed on
    its power-of-two bucket) tunes once, under the key the run uses; its backward runs on slices of
    at most AUTO_TIMED_CLASSES classes (the transient weight gradient), as often as covers the shard."""
    import shardfc.head.function as function
    import shardfc.head.module as module
    from shardfc.head.fused import autotune, shard

    selector, _ = auto_on_gpu
    selector.clock = _Clock([1.0, 2.0, 3.0], steps=STEPS)  # triton fastest: the real forward runs the kernel too
    monkeypatch.setattr(module, "AUTO_TIMED_CLASSES", 8)  # 37 classes: slices of 8, 5 of them
    forwards, backwards = [], []

    def spy_forward(*args, **kw):
        forwards.append(args[7])  # n_cls: the class count the kernel (and its autotune key) sees
        return fused_forward(*args, **kw)

    def spy_backward(real):
        def backward(a, w, *args, rows=None, **kw):
            backwards.append(w.shape[0] if rows is None else rows.numel())
            return real(a, w, *args, rows=rows, **kw)

        return backward

    fused_forward = shard._fused_forward
    monkeypatch.setattr(shard, "_fused_forward", spy_forward)
    monkeypatch.setattr(shard, "shard_backward", spy_backward(shard.shard_backward))
    monkeypatch.setattr(function, "shard_backward", spy_backward(function.shard_backward))
    head = shardfc.ShardedMarginHead(8, 37, impl="auto", device=DEVICE, **kw)
    x, y = torch.randn(6, 8), torch.tensor([0, 5, 9, 36, 20, 1])
    head(x.to(DEVICE), y.to(DEVICE))  # the forward only: every backward seen is the timing's
    assert head.last_impl == "triton"
    real = head.sampled_rows[0].numel() if kw else 37  # the classes the step's own forward scored
    # each triton candidate (one per chunk scale) runs it at its warm-up + STEPS timed calls, then the step's own
    assert forwards[-1] == real and len(forwards) == 4 * (1 + STEPS) + 1
    assert {autotune.bucket(n) for n in forwards} == {autotune.bucket(real)}
    # each of the 9 candidates x (1 + STEPS) calls runs the backward k = ceil(n / 8) times on ceil(n / k) <= 8 classes
    k = -(-real // 8)
    assert len(backwards) == 9 * (1 + STEPS) * k and set(backwards) == {-(-real // k)} and max(backwards) <= 8


def test_the_impl_names_and_their_checks():
    from shardfc.head import fused

    assert [fused.check_impl(n) for n in fused.IMPLS] == ["auto", "triton", "gemm", "torch"]
    for bad in (None, 1, ("torch",)):
        with pytest.raises(ValueError, match=rf"impl must be one of \('auto', 'triton', 'gemm', 'torch'\), got {re.escape(repr(bad))}$"):
            fused.check_impl(bad)
    assert [fused.check_chunk_scale(s) for s in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert fused.check_chunk_scale(None, none_ok=True) is None
    assert fused.check_chunk_scale(4, "x", none_ok=True) == 4
    with pytest.raises(ValueError, match=r"^chunk_scale must be one of \(1, 2, 4, 8\), got None$"):
        fused.check_chunk_scale(None)
    with pytest.raises(ValueError, match=r"^scale must be None or one of \(1, 2, 4, 8\), got 3$"):
        fused.check_chunk_scale(3, "scale", none_ok=True)


def test_the_timed_names_and_their_split():
    from shardfc.head import fused

    assert fused.TIMED == ("triton@1", "triton@2", "triton@4", "triton@8", "gemm@1", "gemm@2", "gemm@4", "gemm@8", "torch")
    assert fused.timed_candidates() == fused.TIMED
    assert fused.timed_candidates(4) == ("triton@4", "gemm@4", "torch")
    assert fused.timed_candidates(1) == ("triton@1", "gemm@1", "torch")
    assert fused.split_timed("gemm@4") == ("gemm", 4) and fused.split_timed("triton@8", 2) == ("triton", 8)
    assert fused.split_timed("torch") == ("torch", None) and fused.split_timed("gemm", 2) == ("gemm", 2)


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("1", True), ("true", True)])
def test_interpreting_reads_triton_interpret(monkeypatch, value, on):
    from shardfc.head import fused

    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert fused.interpreting() is on


def test_why_triton_cannot_run_and_which_impl_runs(monkeypatch):
    from shardfc.head import fused

    cuda, meta, cpu, f32, bf16, f16 = torch.device("cuda"), torch.device("meta"), torch.device("cpu"), torch.float32, torch.bfloat16, torch.float16
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for device in (cuda, meta, cpu):
        for compute in (f32, bf16, f16):
            assert fused.triton_unavailable(device, compute, f32) is None
    assert fused.triton_unavailable(cuda, torch.float64, f32) == "compute dtype torch.float64 is not one of fp32, bf16, fp16"
    assert fused.triton_unavailable(cuda, f32, bf16) == "the kernels keep fp32 statistics; inputs of torch.bfloat16 need impl='torch'"
    assert fused.resolve_impl("torch", cpu, torch.float64, torch.float64) == "torch"
    assert fused.resolve_impl("torch", cuda, f32, f32) == "torch"  # never timed against the others
    assert fused.resolve_impl("triton", cpu, f32, f32) == "triton" and fused.resolve_impl("gemm", meta, bf16, f32) == "gemm"
    assert fused.resolve_impl("auto", cuda, f32, f32) == "auto"
    assert fused.resolve_impl("auto", meta, f32, f32) == fused.resolve_impl("auto", cpu, f32, f32) == "torch"
    assert fused.resolve_impl("auto", cuda, f32, torch.float64) == "torch"
    with pytest.raises(ValueError, match=r"^impl='gemm' cannot run: compute dtype torch.float64 is not one of fp32, bf16, fp16$"):
        fused.resolve_impl("gemm", cuda, torch.float64, f32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert fused.triton_unavailable(cpu, f32, f32) == (
        "the head's tensors are on cpu, not a CUDA device (TRITON_INTERPRET=1 runs the kernels on CPU tensors "
        "with Triton's interpreter, for tests)")
    assert fused.triton_unavailable(torch.device("cuda", 1), f32, f32) is None
    assert fused.shapes_only(torch.empty(1, device="meta")) and not fused.shapes_only(torch.empty(1))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert fused.triton_unavailable(cuda, f32, f32) == "Triton is not installed (pip install 'shardfc[gpu]')"
