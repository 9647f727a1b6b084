"""Classes per chunk of the GEMM path (``chunks.chunk_classes``) as sized on a GPU, from the device's
L2 (issue 31 item 5), and ``gx += E·Ŵ`` as one ``addmm``. Every other test here runs under Triton's
interpreter, whose chunks are a fixed 16 classes, so the GPU's sizing is checked here by itself,
against its rule and figures worked out by hand: the chunk's working set — ``[B, K·c]`` products,
``K·c`` operand rows and, in the backward, their fp32 ``H`` and the rows the row kernel streams —
in ``CHUNK_L2_SHARE`` of the L2, ``c`` a multiple of 128, no more than the shard rounded up to 128."""


from __future__ import annotations

import pytest
import torch

from shardfc.head import kernels
from shardfc.head.fused import chunks

META = torch.device("meta")


@pytest.fixture
def compiled(monkeypatch):
    """Sizes as on a GPU (not the interpreter's small fixed chunks)."""
    monkeypatch.setattr(chunks, "interpreting", lambda: False)


@pytest.mark.parametrize("B, K, D, elem, row_bytes", [
    (1024, 1, 512, 2, None), (1024, 1, 512, 2, 512 * 8), (1024, 1, 512, 2, 512 * 4),
    (256, 3, 128, 2, 128 * 4), (4096, 1, 512, 4, 512 * 8), (128, 1, 64, 2, None),
])
def test_the_working_set_fills_the_l2_share_without_passing_it(compiled, B, K, D, elem, row_bytes):
    l2 = chunks.META_L2_BYTES
    c = chunks.chunk_classes(10**7, B, K, D, elem, META, row_bytes)
    per_class = K * (B * elem + D * elem + (4 * D + row_bytes if row_bytes is not None else 0))
    assert c % chunks.CHUNK_QUANTUM == 0
    assert c * per_class <= chunks.CHUNK_L2_SHARE * l2  # fits
    assert (c + chunks.CHUNK_QUANTUM) * per_class > chunks.CHUNK_L2_SHARE * l2  # and is as large as fits


def test_headline_shapes_and_the_limits(compiled, monkeypatch):
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, 512 * 8) == 3328  # fused SGD with momentum
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, 512 * 4) == 4352  # the gradient written
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META) == 10240  # the gemm forward: products + rows
    assert chunks.chunk_classes(300, 1024, 1, 512, 2, META) == 384  # never past the shard (rounded to 128)
    assert chunks.chunk_classes(10**6, 10**6, 1, 512, 2, META) == chunks.CHUNK_QUANTUM  # at least one quantum
    monkeypatch.setattr(chunks, "META_L2_BYTES", 2 * chunks.META_L2_BYTES)
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, 512 * 8) == 6784  # twice the L2


def test_the_backward_sizes_its_chunks_for_what_its_row_kernel_streams():
    w = torch.empty(10, 8, device=META)
    update = chunks.RowUpdate(w, torch.empty(10, 8, dtype=torch.bfloat16, device=META), 0.1, 0.9, 0.0, False)
    assert chunks._row_bytes(update, w) == 8 * 4 + 8 * 2
    assert chunks._row_bytes(None, torch.empty(10, 8, dtype=torch.bfloat16, device=META)) == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_addmm_f32_adds_the_product_into_fp32(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(33, 17, generator=g).to(dtype)
    b = torch.randn(17, 9, generator=g).to(dtype)
    c = torch.randn(33, 9, generator=g)
    ref = c.double() + a.double() @ b.double()
    out = kernels.addmm_f32(c, a, b)
    assert out is c and c.dtype == torch.float32
    torch.testing.assert_close(c.double(), ref, rtol=1e-5, atol=1e-5)


def test_addmm_f32_on_meta_is_one_gemm_with_an_fp32_output_as_on_cuda():
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    c = torch.empty(4, 3, device=META)
    a, b = torch.empty(4, 8, dtype=torch.bfloat16, device=META), torch.empty(8, 3, dtype=torch.bfloat16, device=META)
    with Spy():
        out = kernels.addmm_f32(c, a, b)
    assert seen == ["addmm"] and out is c


@pytest.mark.parametrize("n_cls,batch,K,D,elem,row_bytes,expected", [
    (10**6, 1024, 1, 512, 2, 4096, 3328),  # 0.6 x 50 MiB / (2048 + 1024 + 2048 + 4096) = 3413.3: down to 26 x 128
    (10**6, 1000, 3, 128, 4, 512, 1792),  # sub-centres, K rows a class: 31457280 / (3 x (4000 + 512 + 512 + 512)) = 1894.3: 14 x 128
    (300, 1024, 1, 512, 2, None, 384),  # a small shard: its 300 classes, rounded up to 3 x 128
    (10**6, 10**6, 1, 512, 2, None, 128),  # a huge batch: never fewer than 128
    (10**6, 0, 1, 512, 2, None, 30720),  # no batch (a rank without samples): the operand rows alone
    (0, 64, 1, 512, 2, None, 128),  # an empty shard
])
def test_chunk_classes_by_hand(monkeypatch, n_cls, batch, K, D, elem, row_bytes, expected):
    monkeypatch.setattr(chunks, "interpreting", lambda: False)
    assert chunks.chunk_classes(n_cls, batch, K, D, elem, META, row_bytes) == expected
    monkeypatch.setattr(chunks, "interpreting", lambda: True)
    assert chunks.chunk_classes(n_cls, batch, K, D, elem, META, row_bytes) == chunks.INTERPRETER_CHUNK == 16
