"""``mm_f32`` / ``addmm_f32`` on CUDA, from the CPU: which GEMM each takes on a CUDA torch with and
without ``addmm(..., out_dtype=)``, and that the fallback (a GEMM with an fp32 output, then an add) is
``c + a @ b`` as float64 computes it, within fp32 accumulation's bound.

No CPU torch has the 16-bit GEMMs with an fp32 output, so CUDA is stood in for: the operands are CPU
tensors that say they are on CUDA, and those GEMMs are computed as cuBLAS does (fp32 products and
accumulation); ``addmm(..., out_dtype=)`` on a torch without it raises as torch's dispatcher does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

from shardfc.head import kernels

M, K, N = 33, 40, 9


class _OnCuda(torch.Tensor):
    """A CPU tensor whose ``device`` says CUDA; records the GEMMs run on it (``calls``)."""

    calls: list = []
    has_addmm_out_dtype = True

    @property
    def device(self):
        return torch.device("cuda")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = tree_map(lambda t: t.as_subclass(torch.Tensor) if isinstance(t, cls) else t, (args, kwargs))
        args, kwargs = plain
        if "out_dtype" in kwargs and func in (torch.mm, torch.addmm):
            name = func.__name__ + "(out_dtype)"
            cls.calls.append(name)
            if func is torch.addmm and not cls.has_addmm_out_dtype:
                raise NotImplementedError("Could not run 'aten::addmm.dtype_out' with arguments from the 'CUDA' backend")
            assert kwargs.pop("out_dtype") == torch.float32
            if func is torch.mm:
                return torch.mm(args[0].float(), args[1].float())
            c, a, b = args
            return kwargs["out"].copy_(c + torch.mm(a.float(), b.float()))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _operands(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    c = torch.randn(M, N, generator=g)
    return c, a, b


def _within_fp32_accumulation(out, c, a, b):
    """|out - (c + a·b)| ≤ (K + 1)·u·(|c| + |a|·|b|) elementwise: a sum of K exact products (16-bit
    operands multiply exactly in fp32) and ``c``, each addition rounded once to fp32."""
    ref = c.double() + a.double() @ b.double()
    bound = (K + 1) * torch.finfo(torch.float32).eps / 2 * (c.double().abs() + a.double().abs() @ b.double().abs())
    assert out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= bound).all(), float(((out.double() - ref).abs() / bound).max())


@pytest.mark.parametrize("has_addmm", [True, False], ids=["addmm-out-dtype", "without"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_addmm_f32_on_cuda_takes_one_gemm_where_torch_has_it_and_falls_back_where_not(monkeypatch, dtype, has_addmm):
    monkeypatch.setattr(kernels, "OUT_DTYPE_WORKS", {})  # nothing tried yet in this process
    monkeypatch.setattr(_OnCuda, "calls", [])
    monkeypatch.setattr(_OnCuda, "has_addmm_out_dtype", has_addmm)
    for call in range(2):
        c, a, b = _operands(dtype)
        before = c.clone()
        _OnCuda.calls.clear()
        out = kernels.addmm_f32(c, a.as_subclass(_OnCuda), b.as_subclass(_OnCuda))
        assert out is c  # in place
        # one GEMM adding into c where torch has it; else a GEMM with an fp32 output, then the add —
        # the refused addmm tried at the first call only (kernels.OUT_DTYPE_WORKS)
        expected = ["addmm(out_dtype)"] if has_addmm else ["addmm(out_dtype)"] * (call == 0) + ["mm(out_dtype)"]
        assert _OnCuda.calls == expected, call
        _within_fp32_accumulation(c, before, a, b)
    assert kernels.OUT_DTYPE_WORKS[("addmm", "cuda")] is has_addmm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mm_f32_on_cuda_is_one_gemm_with_an_fp32_output(monkeypatch, dtype):
    monkeypatch.setattr(_OnCuda, "calls", [])
    _, a, b = _operands(dtype)
    out = kernels.mm_f32(a.as_subclass(_OnCuda), b.as_subclass(_OnCuda))
    assert _OnCuda.calls == ["mm(out_dtype)"]
    _within_fp32_accumulation(out, torch.zeros(M, N), a, b)


@pytest.mark.parametrize("op", ["addmm", "mm"])
def test_a_torch_without_out_dtype_falls_back_once_to_fp32_products(monkeypatch, caplog, op):
    """Where torch's CUDA build refuses ``out_dtype=`` with 16-bit operands (RuntimeError), the GEMM
    is made from fp32 copies — the same products to fp32 rounding — chosen at the first call and
    kept: the refused call is not tried again (issue 42 item 5). Here the CUDA branch runs on CPU
    tensors, with torch's operator made to refuse as such a build would."""
    monkeypatch.setattr(kernels, "_gemm_device", lambda a: "cuda")
    monkeypatch.setattr(kernels, "OUT_DTYPE_WORKS", {})
    tried = []
    real = getattr(torch, op)

    def refusing(*args, **kw):
        if "out_dtype" in kw:
            tried.append(kw["out_dtype"])
            raise RuntimeError(f"{op}: out_dtype is not supported here\n(the rest of torch's message)")
        return real(*args, **kw)

    monkeypatch.setattr(torch, op, refusing)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(33, 17, generator=g).bfloat16(), torch.randn(17, 9, generator=g).bfloat16()
    for _ in range(3):
        c = torch.randn(33, 9, generator=g)
        ref = (c.double() if op == "addmm" else 0) + a.double() @ b.double()
        out = kernels.addmm_f32(c, a, b) if op == "addmm" else kernels.mm_f32(a, b)
        assert out.dtype == torch.float32 and (op == "mm" or out is c)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert tried == [torch.float32] and kernels.OUT_DTYPE_WORKS[(op, "cpu")] is False
    said = [r for r in caplog.records if r.getMessage().startswith(f"torch.{op}(")]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert said[0].getMessage() == (f"torch.{op}(..., out_dtype=torch.float32) is not available on cpu ({op}: out_dtype "
                                    "is not supported here): the fp32 products are made from fp32 copies of the "
                                    "operands instead (slower, same accuracy)")


def test_a_refusal_without_a_message_is_named_by_its_type(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "OUT_DTYPE_WORKS", {})

    def refuse():
        raise TypeError()

    assert kernels._with_out_dtype("mm", "cuda", refuse, lambda: torch.zeros(1)).shape == (1,)
    (said,) = [r.getMessage() for r in caplog.records if "out_dtype" in r.getMessage()]
    assert said.startswith("torch.mm(..., out_dtype=torch.float32) is not available on cuda (TypeError): ")


def test_out_dtype_is_kept_once_it_works(monkeypatch):
    monkeypatch.setattr(kernels, "OUT_DTYPE_WORKS", {})
    calls = []
    assert kernels._with_out_dtype("mm", "cuda", lambda: calls.append("fast") or torch.ones(1),
                                   lambda: calls.append("slow") or torch.zeros(1)).item() == 1.0
    kernels._with_out_dtype("mm", "cuda", lambda: calls.append("fast") or torch.ones(1), lambda: torch.zeros(1))
    assert calls == ["fast", "fast"] and kernels.OUT_DTYPE_WORKS[("mm", "cuda")] is True
