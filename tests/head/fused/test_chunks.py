"""Classes per chunk of the GEMM path (``chunks.chunk_classes``) as sized on a GPU, from the device's
L2 (issue 31 item 5), and ``gx += E·Ŵ`` as one ``addmm``. Every other test here runs under Triton's
interpreter, whose chunks are a fixed 16 classes, so the GPU's sizing is checked here by itself,
against its rule and figures worked out by hand: the chunk's working set — what is reused: ``[B, K·c]``
products, ``K·c`` operand rows and, in the backward, their fp32 ``H``; not the rows the row kernel
streams once — in ``CHUNK_L2_SHARE`` of the L2, ``c`` a multiple of 128, times the chunk scale, no more
than the shard rounded up to 128; and the per-row kernels' programs, a few waves on 132 SMs (issue 42)."""


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


@pytest.mark.parametrize("B, K, D, elem, backward", [
    (1024, 1, 512, 2, False), (1024, 1, 512, 2, True), (256, 3, 128, 2, True), (4096, 1, 512, 4, True),
    (128, 1, 64, 2, False),
])
def test_the_working_set_fills_the_l2_share_without_passing_it(compiled, B, K, D, elem, backward):
    l2 = chunks.META_L2_BYTES
    c = chunks.chunk_classes(10**7, B, K, D, elem, META, backward)
    per_class = K * (B * elem + D * elem + (4 * D if backward else 0))  # streamed rows take no share
    assert c % chunks.CHUNK_QUANTUM == 0
    assert c * per_class <= chunks.CHUNK_L2_SHARE * l2  # fits
    assert (c + chunks.CHUNK_QUANTUM) * per_class > chunks.CHUNK_L2_SHARE * l2  # and is as large as fits
    for scale in chunks.CHUNK_SCALES:  # a larger scale: that many L2-sized chunks in one
        assert chunks.chunk_classes(10**7, B, K, D, elem, META, backward, scale) == c * scale


def test_headline_shapes_and_the_limits(compiled, monkeypatch):
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, True) == 6144  # the backward: products + rows + H
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META) == 10240  # the gemm forward: products + rows
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, True, 4) == 24576
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, True, None) == 6144 * chunks.DEFAULT_CHUNK_SCALE
    assert chunks.chunk_classes(300, 1024, 1, 512, 2, META) == 384  # never past the shard (rounded to 128)
    assert chunks.chunk_classes(300, 1024, 1, 512, 2, META, True, 8) == 384
    assert chunks.chunk_classes(10**6, 10**6, 1, 512, 2, META) == chunks.CHUNK_QUANTUM  # at least one quantum
    monkeypatch.setattr(chunks, "META_L2_BYTES", 2 * chunks.META_L2_BYTES)
    assert chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, True) == 12288  # twice the L2


@pytest.mark.parametrize("bad", [0, 3, 16, True, 2.0, "2"])
def test_a_chunk_scale_outside_the_list_is_refused(bad):
    with pytest.raises(ValueError, match=r"chunk_scale must be one of \(1, 2, 4, 8\)"):
        chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, True, bad)


@pytest.mark.parametrize("widest", [chunks.ROW_TILES[0], chunks.UPDATE_TILES[0], chunks.ADAMW_UPDATE_TILES[0]])
@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_the_row_kernels_launch_a_few_waves_per_chunk(compiled, widest, scale):
    """The update and weight-gradient kernels of one headline chunk fill an H100 (132 SMs) ``ROW_WAVES``
    times over: before, 3,328 rows at 32 a program were 104 programs, under one wave."""
    sms = 132
    n_rows = chunks.chunk_classes(10**6, 1024, 1, 512, 2, META, True, scale)
    br = chunks.row_tile(n_rows, widest, META)
    assert br in (widest, chunks.MIN_ROW_TILE)  # the two tiles the sm_90 build holds
    assert -(-n_rows // br) >= chunks.ROW_WAVES * sms  # a few waves ...
    assert br == widest or -(-n_rows // widest) < chunks.ROW_WAVES * sms  # ... at the widest tile that gives them


def test_row_tiles_of_small_grids_and_off_the_gpu(compiled):
    assert chunks.row_tile(100, 32, META) == chunks.MIN_ROW_TILE  # too few rows for the waves: the narrowest
    assert chunks.row_tile(10**6, 32, META) == 32  # a whole shard's operand pass: waves at full width
    assert chunks.row_tile(100, 32, torch.device("cpu")) == 32  # the interpreter's tiles are fixed


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


@pytest.mark.parametrize("n_cls,batch,K,D,elem,backward,expected", [
    (10**6, 1024, 1, 512, 2, True, 6144),  # 0.6 x 50 MiB / (2048 + 1024 + 2048) = 6144 = 48 x 128
    (10**6, 1000, 3, 128, 4, True, 2048),  # sub-centres, K rows a class: 31457280 / (3 x (4000 + 512 + 512)) = 2087.1: 16 x 128
    (300, 1024, 1, 512, 2, False, 384),  # a small shard: its 300 classes, rounded up to 3 x 128
    (10**6, 10**6, 1, 512, 2, False, 128),  # a huge batch: never fewer than 128
    (10**6, 0, 1, 512, 2, False, 30720),  # no batch (a rank without samples): the operand rows alone
    (0, 64, 1, 512, 2, False, 128),  # an empty shard
])
def test_chunk_classes_by_hand(monkeypatch, n_cls, batch, K, D, elem, backward, expected):
    monkeypatch.setattr(chunks, "interpreting", lambda: False)
    got = chunks.chunk_classes(n_cls, batch, K, D, elem, META, backward)
    assert got == expected and type(got) is int  # a count of classes: it sizes slices and ranges
    monkeypatch.setattr(chunks, "interpreting", lambda: True)
    assert chunks.chunk_classes(n_cls, batch, K, D, elem, META, backward) == chunks.INTERPRETER_CHUNK == 16
    assert chunks.chunk_classes(n_cls, batch, K, D, elem, META, backward, 4) == 4 * chunks.INTERPRETER_CHUNK



def test_l2_bytes_of_a_cuda_device_its_own_or_the_current_ones(monkeypatch):
    seen = []
    monkeypatch.setattr(chunks, "_cuda_l2_bytes", lambda index: seen.append(index) or 1000 * (index + 1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert chunks.l2_bytes(torch.device("cuda", 1)) == 2000
    assert chunks.l2_bytes(torch.device("cuda")) == 4000
    assert chunks.l2_bytes(torch.device("cuda", 0)) == 1000
    assert seen == [1, 3, 0]
    assert chunks.l2_bytes(META) == chunks.l2_bytes(torch.device("cpu")) == chunks.META_L2_BYTES == 50 * 2**20


def test_row_tiles_on_a_cuda_device_from_its_own_sm_count(compiled, monkeypatch):
    seen = []
    monkeypatch.setattr(chunks.autotune, "sm_count", lambda index: seen.append(index) or 10)
    # 10 SMs, 4 waves: 40 programs of 32 rows; 1,248 rows are 39
    assert chunks.row_tile(1280, 32, torch.device("cuda", 2)) == 32
    assert chunks.row_tile(1248, 32, torch.device("cuda")) == chunks.MIN_ROW_TILE == 8
    assert chunks.row_tile(100, 4, torch.device("cuda")) == 4  # never wider than the widest
    assert seen == [2, 0, 0]
    assert chunks.row_tile(32 * 4 * 132, 32, META) == 32 and chunks.row_tile(32 * 4 * 132 - 32, 32, META) == 8


def test_tiles_by_options_and_place(monkeypatch):
    assert [chunks.heavy(K, f) for K, f in ((1, False), (2, False), (1, True), (3, True))] == [False, True, True, True]
    assert chunks.unit_for(torch.float16) == 2.0**15 and chunks.unit_for(torch.bfloat16) == chunks.unit_for(torch.float32) == 1.0
    assert chunks._block_tiles(2, False) == chunks.INTERPRETER_TILES == (16, 16)  # the interpreter's tiles
    assert chunks.emulate_rtne(torch.empty(1, dtype=torch.bfloat16))
    assert not chunks.emulate_rtne(torch.empty(1, dtype=torch.float16))
    monkeypatch.setattr(chunks, "interpreting", lambda: False)
    assert chunks._block_tiles(1, False) == chunks.EPILOGUE_TILES == (32, 128)
    assert chunks._block_tiles(2, False) == chunks._block_tiles(1, True) == chunks.HEAVY_EPILOGUE_TILES == (32, 64)
    assert chunks._tiles(chunks.ROW_TILES) == (32, 128)
    assert not chunks.emulate_rtne(torch.empty(1, dtype=torch.bfloat16))  # a GPU rounds to nearest itself


def test_a_row_updates_numbers_and_state():
    import struct

    w, buf, m, v, steps = (torch.zeros(4, 2) for _ in range(5))
    sgd = chunks.RowUpdate(w, buf, 0.5, 0.9, 1e-4, True)
    assert sgd.hyper_values() == (0.5, 0.9, 1e-4) and all(type(x) is float for x in sgd.hyper_values())
    assert not sgd.is_adamw and sgd.state() == [w, buf] and [x is y for x, y in zip(sgd.state(), (w, buf))] == [True, True]
    assert chunks.RowUpdate(w, None, 1, 0, 0, False).state()[0] is w and len(chunks.RowUpdate(w, None, 1, 0, 0, False).state()) == 1
    adamw = chunks.RowUpdate.adamw(w, m, v, steps, 1e-3, (0.8, 0.99), 1e-6, 0.05)
    assert (adamw.momentum_buffer, adamw.momentum, adamw.nesterov, adamw.row_step, adamw.weight_decay) == (None, 0.0, False, steps, 0.05)
    assert adamw.is_adamw and [t is x for t, x in zip(adamw.state(), (w, m, v))] == [True] * 3 and len(adamw.state()) == 3
    lr, decay, b1_hi, b1_lo, b2_hi, b2_lo, one_b1, one_b2, eps = adamw.hyper_values()
    assert (lr, decay, one_b1, one_b2, eps) == (1e-3, 1.0 - 1e-3 * 0.05, 1.0 - 0.8, 1.0 - 0.99, 1e-6)
    for beta, hi, lo in ((0.8, b1_hi, b1_lo), (0.99, b2_hi, b2_lo)):
        assert hi == struct.unpack("f", struct.pack("f", beta))[0] != beta  # the fp32 nearest
        assert lo == struct.unpack("f", struct.pack("f", beta - hi))[0] != 0.0
        assert abs(hi + lo - beta) <= beta * 2.0**-48
    assert chunks._split(0.5) == (0.5, 0.0) and chunks._fp32(1 + 2.0**-30) == 1.0
    held = torch.ones(3)
    assert chunks.RowUpdate(w, buf, 0.5, 0.9, 0.0, False, hyper=held).hyper_on(META) is held
    assert sgd.hyper_on(torch.device("cpu")).tolist() == torch.tensor([0.5, 0.9, 1e-4]).tolist()
    assert adamw.hyper_on(META).shape == (9,) and adamw.hyper_on(META).device == META
