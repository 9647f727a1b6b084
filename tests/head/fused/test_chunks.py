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
from shardfc.tools.bench.memory import LiveTensorBytes

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


class _OpSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """The operators that ran (an operator that raised is not listed)."""

    def __init__(self):
        super().__init__()
        self.ran = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ran.append(func.overloadpacket.__name__)
        return out


def _meta_operands():
    c = torch.empty(4, 3, device=META)
    a, b = torch.empty(4, 8, dtype=torch.bfloat16, device=META), torch.empty(8, 3, dtype=torch.bfloat16, device=META)
    return c, a, b


def _meta_addmm_f32():
    """``addmm_f32`` on meta operands: its result, the operators that ran, the bytes of new storages."""
    c, a, b = _meta_operands()
    with LiveTensorBytes() as memory, _OpSpy() as spy:
        out = kernels.addmm_f32(c, a, b)
    assert out is c and out.dtype == torch.float32
    return spy.ran, memory.peak


def _refuse_out_dtype(monkeypatch, op: str, error: Exception) -> None:
    """``torch.<op>`` raises ``error`` when given ``out_dtype``, as a torch without it would."""
    real = getattr(torch, op)

    def refusing(*args, **kw):
        if "out_dtype" in kw:
            raise error
        return real(*args, **kw)

    monkeypatch.setattr(torch, op, refusing)


def test_addmm_f32_on_meta_is_one_gemm_with_an_fp32_output_as_on_cuda(monkeypatch):
    """The plan's replay (meta) counts one GEMM writing into ``c``, as CUDA runs it: ``addmm`` where
    torch's meta path takes ``out_dtype``, else the stand-in below; no new storage either way."""
    monkeypatch.setattr(kernels, "OUT_DTYPE_WORKS", {})
    ran, new_bytes = _meta_addmm_f32()
    assert ran in (["addmm"], ["mm"]) and new_bytes == 0


def test_addmm_f32_on_a_meta_path_that_refuses_out_dtype_stands_in_one_gemm_into_c(monkeypatch, caplog):
    """torch 2.11's meta ``addmm(out_dtype=)`` raises (a TypeError: its decomposition takes the dtype
    for ``beta``); the replay then counts one ``mm`` with an fp32 output written into ``c`` — not a
    ``[M, N]`` product and an add, which CUDA does not run — and says so at info level, not as a
    warning of a slower path (nothing runs slower)."""
    monkeypatch.setattr(kernels, "OUT_DTYPE_WORKS", {})
    _refuse_out_dtype(monkeypatch, "addmm", TypeError("unsupported operand type(s) for *: 'torch.dtype' and 'Tensor'"))
    with caplog.at_level("INFO", logger=kernels._log.name):
        for _ in range(2):
            assert _meta_addmm_f32() == (["mm"], 0)
    assert kernels.OUT_DTYPE_WORKS[("addmm", "meta")] is False
    said = [r for r in caplog.records if "out_dtype" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO"
    assert said[0].getMessage() == ("torch.addmm(..., out_dtype=torch.float32) is not available on meta (unsupported "
                                    "operand type(s) for *: 'torch.dtype' and 'Tensor'): the plan's replay counts a "
                                    "stand-in for it")


def test_addmm_f32_on_a_meta_path_without_any_out_dtype_adds_an_fp32_product(monkeypatch):
    """A torch whose meta path has no ``out_dtype`` at all: the products in fp32, then the add."""
    monkeypatch.setattr(kernels, "OUT_DTYPE_WORKS", {})
    for op in ("addmm", "mm"):
        _refuse_out_dtype(monkeypatch, op, RuntimeError("out_dtype is not supported"))
    ran, new_bytes = _meta_addmm_f32()
    assert ran[-2:] == ["mm", "add_"] and new_bytes >= 4 * 3 * 4  # the [4, 3] fp32 product at least


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


# The launchers around the row kernels, under the interpreter, against plain torch on the same rows.

def _weight(n=21, d=24, zero_row=5):
    """Rows of assorted norms, one of them all zeros (its 1/‖w‖ is 0, as the torch path has it)."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, d, generator=g) * torch.linspace(0.5, 3.0, n).unsqueeze(1)
    w[zero_row] = 0
    return w


def _inv_of(rows: torch.Tensor) -> torch.Tensor:
    norm = rows.double().norm(dim=1)
    return torch.where(norm > 0, 1 / norm, torch.zeros_like(norm)).float()


#: fp32 sums of D = 24 squares in another order: a few units of fp32 rounding (2⁻²⁴) a term
FP32_TOL = 24 * 2.0**-24


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return bool(((got.double() - want.double()).abs() <= rel * want.double().abs() + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [3, 20, 5, 0, 11, 7]], ids=["every_row", "gathered"])
@pytest.mark.parametrize("normalize,need_inv", [(True, True), (False, True), (False, False)])
def test_scored_rows_are_the_rows_gathered_normalised_and_cast(dtype, rows, normalize, need_inv):
    """``(operand, inv)``: the scored rows (through ``rows``) times ``1/‖w‖`` when normalised, in the
    compute dtype (bf16: rounded to nearest, so within half a bf16 unit of the fp32 product's
    rounding, one unit allowed), and the norms when asked for."""
    w = _weight()
    idx = None if rows is None else torch.tensor(rows)
    picked = w if idx is None else w[idx]
    operand, inv = chunks.scored_rows(w, idx, picked.shape[0], dtype, normalize, need_inv)
    want_inv = _inv_of(picked)
    want = picked * want_inv.unsqueeze(1) if normalize else picked
    assert operand.dtype == dtype and operand.shape == picked.shape
    rel = 2 * FP32_TOL if dtype == torch.float32 else 2.0**-8 + 2 * FP32_TOL
    assert _close(operand, want, rel)
    if need_inv:
        assert inv.dtype == torch.float32 and inv.shape == (picked.shape[0],)
        assert _close(inv, want_inv, FP32_TOL) and float(inv[rows.index(5) if rows else 5]) == 0.0
    else:
        assert inv is None


def test_scored_rows_above_the_operand_budget_make_the_norms_only(monkeypatch):
    """Past :data:`chunks.OPERAND_BYTES` no operand (each chunk makes its own), the norms still;
    exactly at it, the operand; no rows: empty tensors and nothing launched."""
    w = _weight()
    monkeypatch.setattr(chunks, "OPERAND_BYTES", 21 * 24 * 2)  # the bf16 operand's size exactly
    operand, inv = chunks.scored_rows(w, None, 21, torch.bfloat16, True, True)
    assert operand is not None and _close(operand, w * _inv_of(w).unsqueeze(1), 2.0**-8 + 2 * FP32_TOL)
    operand, inv = chunks.scored_rows(w, None, 21, torch.float32, True, True)
    assert operand is None and _close(inv, _inv_of(w), FP32_TOL)
    monkeypatch.setattr(chunks, "OPERAND_BYTES", 21 * 24 * 2 - 1)  # one byte short of the bf16 operand
    operand, inv = chunks.scored_rows(w, None, 21, torch.bfloat16, True, True)
    assert operand is None and _close(inv, _inv_of(w), FP32_TOL)
    assert chunks.scored_rows(w, None, 21, torch.float32, False, False) == (None, None)
    launched = []
    monkeypatch.setattr(chunks, "_operand_launch", lambda *args: launched.append(args))
    operand, inv = chunks.scored_rows(w, None, 0, torch.bfloat16, True, True)
    assert operand.shape == (0, 24) and inv.shape == (0,) and launched == []


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("rows", [None, [3, 20, 5, 0, 11, 7, 9, 2]], ids=["every_row", "gathered"])
def test_operand_rows_are_one_chunks_rows_times_the_step_s_norms(rows, scale):
    """Rows ``r0 .. r0 + n`` of the scored rows, times their entries of ``inv`` (the step's norms,
    indexed by scored row, not by the chunk's own row) when ``scale``, in the compute dtype."""
    w = _weight()
    idx = None if rows is None else torch.tensor(rows)
    picked = w if idx is None else w[idx]
    inv = torch.linspace(0.25, 2.0, picked.shape[0])  # not the true norms: what it reads shows
    r0, n = 2, 5
    out = chunks.operand_rows(w, idx, inv, r0, n, torch.float32, scale)
    want = picked[r0:r0 + n] * (inv[r0:r0 + n].unsqueeze(1) if scale else 1)
    assert out.shape == (n, 24) and out.dtype == torch.float32
    assert _close(out, want, 2.0**-24)
    assert chunks.operand_rows(w, idx, inv, r0, 0, torch.float32, scale).shape == (0, 24)


def test_raw_rows_are_a_view_of_the_chunk_or_its_rows_gathered():
    w = _weight()
    view = chunks._raw_rows(w, None, 4, 9)
    assert view.data_ptr() == w[4].data_ptr() and torch.equal(view, w[4:9])
    rows = torch.tensor([3, 20, 5, 0, 11, 7])
    assert torch.equal(chunks._raw_rows(w, rows, 1, 4), w[[20, 5, 0]])


def test_operand_rows_on_the_meta_device_tell_the_plan_what_they_touch():
    from shardfc.head.fused import traffic

    seen = []
    record = lambda kernel, reads, writes, flops: seen.append((kernel, [r.part[0] + f":{r.nbytes}" for r in reads],  # noqa: E731
                                                               [r.part[0] + f":{r.nbytes}" for r in writes]))
    w, rows = torch.empty(100, 8, device=META), torch.arange(10, device=META)
    with traffic.recording(record):
        made = chunks.scored_rows(w, None, 100, torch.bfloat16, True, True)  # norms written, rows written
        made += (chunks.operand_rows(w, None, made[1], 0, 4, torch.bfloat16, True),)
        assert [(t.device, t.dtype, tuple(t.shape)) for t in made] == [
            (META, torch.bfloat16, (100, 8)), (META, torch.float32, (100,)), (META, torch.bfloat16, (4, 8))]
        seen.clear()
        chunks.scored_rows(w, None, 100, torch.bfloat16, True, True)
        chunks.scored_rows(w, rows, 10, torch.bfloat16, False, False)  # gathered, no norms
        chunks.operand_rows(w, None, torch.empty(100, device=META), 20, 30, torch.bfloat16, True)  # norms read
        chunks.operand_rows(w, None, torch.empty(100, device=META), 20, 30, torch.bfloat16, False)
        chunks.scored_rows(w, None, 0, torch.bfloat16, True, True)  # no rows: nothing
    assert seen == [
        ("operand_rows", ["span:3200"], ["span:1600", "span:400"]),
        ("operand_rows", ["rows:320", "span:80"], ["span:160"]),
        ("operand_rows", ["span:960", "span:120"], ["span:480"]),
        ("operand_rows", ["span:960"], ["span:480"]),
    ]


def test_target_slots_name_one_sample_of_each_target_and_sum_its_terms():
    """``slot``: −1 but at the target rows, where one of the samples with that target; ``t_sum``:
    at the named sample's row, the sum of every such sample's terms, zero at the others."""
    t_scored = torch.tensor([4, 1, 4, 6, 4, 1])
    h_t = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3) + 1
    slot, t_sum = chunks._target_slots(t_scored, h_t, 8)
    assert slot.dtype == torch.int32 and slot.shape == (8,)
    assert [int(s) for s in slot[[0, 2, 3, 5, 7]]] == [-1] * 5
    for row in (1, 4, 6):
        named = int(slot[row])
        assert int(t_scored[named]) == row
        assert torch.equal(t_sum[named], h_t[t_scored == row].sum(0))
    others = [i for i in range(6) if i not in [int(slot[r]) for r in (1, 4, 6)]]
    assert len(others) == 3 and not t_sum[others].any()


@pytest.mark.parametrize("samples", [4, 1])
@pytest.mark.parametrize("scatter", [False, True])
def test_target_rows_correction_is_what_the_added_terms_changed_in_the_sum_of_squares(scatter, samples):
    """Against the sum of squares of the whole gradient after the terms were added less before
    (fp64), from the ``B`` target rows only; rows ``at`` the weight rows (``scatter``: through the
    Partial FC rows) while ``t_scored`` are scored rows."""
    g = torch.Generator().manual_seed(3)
    grad_w = torch.randn(12, 5, generator=g)
    t_scored = torch.tensor([4, 1, 4, 6][:samples])
    rows = torch.tensor([9, 3, 0, 11, 2, 7, 8, 1])  # scored row -> weight row
    at = rows[t_scored] if scatter else t_scored
    h_t = torch.randn(samples, 5, generator=g)
    before = grad_w.double().square().sum()
    grad_w.index_add_(0, at, h_t)
    want = grad_w.double().square().sum() - before
    got = chunks._target_rows_correction(grad_w, at, t_scored, h_t, 8)
    assert got.shape == (1,) and got.dtype == torch.float32
    assert abs(float(got) - float(want)) <= 64 * 2.0**-24 * float(grad_w.double().square().sum())
    empty = chunks._target_rows_correction(grad_w, at[:0], t_scored[:0], h_t[:0], 8)
    assert empty.shape == (1,) and empty.dtype == torch.float32 and float(empty) == 0.0


def test_a_next_operand_is_handed_out_only_for_the_weight_as_it_was_kept():
    import copy
    import pickle

    w, other = torch.randn(6, 4), torch.randn(6, 4)
    operand, inv = torch.randn(6, 4).bfloat16(), torch.rand(6)
    kept = chunks.NextOperand()
    assert (kept.operand, kept.inv, kept.nbytes) == (None, None, 0)
    assert kept.take(w, torch.bfloat16, True, True) is None  # nothing kept
    kept.keep(w, operand, inv, torch.bfloat16, True, True)
    assert kept.nbytes == 6 * 4 * 2 + 6 * 4
    got = kept.take(w, torch.bfloat16, True, True)
    assert got[0] is operand and got[1] is inv
    assert kept.take(w, torch.bfloat16, True, True)[0] is operand  # taking does not forget it
    for differs in [(other, torch.bfloat16, True, True), (w, torch.float16, True, True),
                    (w, torch.bfloat16, False, True), (w, torch.bfloat16, True, False)]:
        kept.keep(w, operand, inv, torch.bfloat16, True, True)
        assert kept.take(*differs) is None
        assert (kept.operand, kept.inv, kept._key) == (None, None, None)  # forgotten
        assert kept.take(w, torch.bfloat16, True, True) is None
    kept.keep(w, operand, None, torch.bfloat16, False, False)
    assert kept.take(w, torch.bfloat16, False, False) == (operand, None) and kept.nbytes == 6 * 4 * 2
    w.mul_(2)  # an in-place change: another _version
    assert kept.take(w, torch.bfloat16, False, False) is None
    kept.keep(w, operand, inv, torch.bfloat16, True, True)
    same_storage = w.view(6, 4)  # the same data, another tensor
    assert kept.take(same_storage, torch.bfloat16, True, True) is None
    kept.keep(w, operand, inv, torch.bfloat16, True, True)
    for clone in (copy.deepcopy(kept), pickle.loads(pickle.dumps(kept)), copy.copy(kept)):
        assert (clone.operand, clone.inv, clone._weight, clone._key) == (None, None, None, None)
    assert kept.take(w, torch.bfloat16, True, True)[0] is operand  # the original keeps it
    kept.clear()
    assert (kept.operand, kept.inv, kept._weight, kept._key) == (None, None, None, None)


def test_the_fp32_results_stay_fp32_under_another_default_dtype():
    """The norms, the forward's partial statistics and the gradient's sum-of-squares correction are fp32 (what the kernels store and
    ``grad_sq`` holds) even where torch's default dtype is fp64."""
    w = _weight()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, inv = chunks.scored_rows(w, None, 21, torch.float32, True, True)
        empty = chunks._target_rows_correction(w, torch.tensor([], dtype=torch.int64),
                                               torch.tensor([], dtype=torch.int64), w[:0], 21)
        a, w4, tcol, tval = _forward_inputs(40, device=META)
        stats = chunks.forward_stats(a.float(), w4.float(), None, None, None, tcol, tval.float(), 40, 1, 4.0, 0.0, False,
                                     True, None)
    finally:
        torch.set_default_dtype(before)
    assert [t.dtype for t in stats] == [torch.float32] * 3  # the forward's statistics too
    assert inv.dtype == torch.float32 and _close(inv, _inv_of(w), FP32_TOL)
    assert empty.dtype == torch.float32


def test_target_slots_and_the_correction_on_the_meta_device_stay_there():
    """``shardfc plan`` runs the backward on meta tensors: what these make is made there too."""
    t_scored, h_t = torch.tensor([4, 1, 4], device=META), torch.empty(3, 5, device=META)
    slot, t_sum = chunks._target_slots(t_scored, h_t, 8)
    assert (slot.device, slot.dtype, tuple(slot.shape), t_sum.device, tuple(t_sum.shape)) == (META, torch.int32, (8,), META, (3, 5))
    empty = chunks._target_rows_correction(torch.empty(8, 5, device=META), t_scored[:0], t_scored[:0], h_t[:0], 8)
    assert (empty.device, empty.dtype, tuple(empty.shape)) == (META, torch.float32, (1,))


def _forward_inputs(n_cls, B=5, D=8, device=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, w = torch.randn(B, D, generator=g), torch.randn(n_cls, D, generator=g)
    tcol = torch.tensor([3, -1, n_cls - 1, 0, 17][:B], dtype=torch.int32)
    tval = torch.randn(B, generator=g)
    if device is not None:
        a, w, tcol, tval = (t.to(device) for t in (a, w, tcol, tval))
    return a, w, tcol, tval


def _combined(pmax, psum, plsum):
    m = pmax.double().amax(dim=1, keepdim=True)
    return m.squeeze(1), (psum.double() * (pmax.double() - m).exp()).sum(dim=1), plsum.double().sum(dim=1)


def test_forward_stats_come_in_two_splits_a_chunk_whatever_the_chunk_scale():
    """Under the interpreter a chunk is 16 classes × the chunk scale and takes two class splits of
    whole 16-column tiles (one where half a chunk is under a tile): 130 classes are 9 chunks of 16
    (8 of them one split each, the last 2 classes one) at scale 1, and at scale 8 a chunk of 128 in
    two splits and one of 2 classes. The statistics folded over the parts are the same either way,
    and equal those of the logits made in fp64 (the target column's value ``tval``)."""
    a, w, tcol, tval = _forward_inputs(130)
    operand, inv = chunks.scored_rows(w, None, 130, torch.float32, True, True)
    got = {}
    for scale, parts in ((1, 9), (8, 3)):
        stats = chunks.forward_stats(a, w, None, inv, None, tcol, tval, 130, 1, 4.0, 0.0, True, True, operand,
                                     chunk_scale=scale)
        assert [tuple(t.shape) for t in stats] == [(5, parts)] * 3 and stats[0].dtype == torch.float32
        got[scale] = _combined(*stats)
    z = 4.0 * a.double() @ (w.double() / w.double().norm(dim=1, keepdim=True)).t()
    on = tcol >= 0
    z[on, tcol[on].long()] = tval[on].double()
    want = (z.amax(dim=1), (z - z.amax(dim=1, keepdim=True)).exp().sum(dim=1), z.sum(dim=1))
    # fp32: each logit a D-term dot product (D units of max|z|), each sum over 130 classes 130 units
    # of the magnitudes summed; an exponential's relative error is its argument's absolute error
    unit, top = 2.0**-24, z.abs().amax(dim=1)
    bounds = (8 * unit * top, (8 * top + 130) * unit * want[1], (8 + 130) * unit * z.abs().sum(dim=1))
    for scale in (1, 8):
        for g_, w_, bound in zip(got[scale], want, bounds):
            assert bool(((g_ - w_).abs() <= bound).all()), scale


@pytest.mark.parametrize("filter_", [False, True], ids=["", "filter"])
@pytest.mark.parametrize("smooth", [True, False])
def test_forward_stats_on_the_meta_device_tell_the_plan_each_chunks_epilogue(smooth, filter_):
    """40 classes at chunk scale 2: chunks of 32 (two splits) and 8 (one). Per chunk one epilogue reading its block of
    products, its rows' norms and the ``[B]`` target columns and values, writing its split's
    columns of the statistics (two of them without smoothing: ``plsum`` is ``pmax`` then); with the
    filter, the chunk's fp32 cosines to the target rows after the products; no pass over the rows
    with the step's operand; the statistics made on the meta device in fp32."""
    from shardfc.head.fused import traffic

    B, D = 5, 8
    a, w, tcol, tval = _forward_inputs(40, B, D, META)
    inv, operand = torch.empty(40, device=META), torch.empty(40, D, device=META)
    seen = []
    record = lambda kernel, reads, writes, flops: seen.append((kernel, [(r.part[0], r.nbytes) for r in reads],  # noqa: E731
                                                               [(r.part, r.nbytes) for r in writes]))
    with traffic.recording(record):
        tr = torch.empty(B, D, device=META) if filter_ else None
        stats = chunks.forward_stats(a, w, None, inv, tr, tcol, tval, 40, 1, 4.0, 0.3, True, smooth, operand,
                                     chunk_scale=2)
    assert [(t.device, t.dtype, tuple(t.shape)) for t in stats] == [(META, torch.float32, (B, 3))] * 3  # 2 + 1 splits
    assert (stats[2] is stats[0]) == (not smooth)
    outs = 3 if smooth else 2
    cosines = [("span", B * n * 4) for n in (32, 8)] if filter_ else [None] * 2
    assert seen == [("forward_epilogue", [("span", B * n * 4)] + [f] * filter_ + [("span", n * 4), ("span", B * 4), ("span", B * 4)],
                     [(("cols", part0, splits), B * splits * 4)] * outs)
                    for (n, part0, splits), f in zip(((32, 0, 2), (8, 2, 1)), cosines)]


@pytest.mark.parametrize("filter_", [False, True], ids=["", "filter"])
def test_forward_stats_above_the_operand_budget_equal_those_with_the_step_s_operand(filter_):
    """bf16 centres and compute: each chunk making its own operand rows (no step operand) gives the
    very statistics the step's operand gives (the same kernel makes the same rows), the filter's
    cosines from the fp32 rows either way."""
    a, w, tcol, tval = _forward_inputs(40)
    a, w = a.bfloat16(), w.bfloat16()
    operand, inv = chunks.scored_rows(w, None, 40, torch.bfloat16, True, True)
    tr = w[tcol.clamp(min=0).long()].float() if filter_ else None
    threshold = 0.2 if filter_ else 0.0
    kept = chunks.forward_stats(a, w, None, inv, tr, tcol, tval, 40, 1, 4.0, threshold, True, True, operand)
    own = chunks.forward_stats(a, w, None, inv, tr, tcol, tval, 40, 1, 4.0, threshold, True, True, None)
    for x, y in zip(kept, own):
        assert torch.equal(x, y)
    if filter_:  # some classes filtered: fewer exponentials than without the filter
        plain = chunks.forward_stats(a, w, None, inv, None, tcol, tval, 40, 1, 4.0, 0.0, True, True, operand)
        assert bool((_combined(*own)[1] < _combined(*plain)[1]).any())


@pytest.mark.parametrize("K,filter_,tile", [(1, False, 128), (1, True, 64), (2, False, 64)])
def test_forward_stats_as_on_a_gpu_take_the_heavy_tiles_with_the_filter_or_sub_centres(compiled, monkeypatch, K, filter_,
                                                                                        tile):
    """On the meta device sized as on a GPU: 1,024 scored rows of a batch of 32 make one chunk and
    far more programs wanted than tiles, so a split is one class tile — 128 columns, 64 with the
    filter or sub-centres (``HEAVY_EPILOGUE_TILES``): the statistics have 1,024 / K / tile parts."""
    from shardfc.head.fused import autotune

    monkeypatch.setattr(autotune, "interpreting", lambda: False)  # the splits wanted as on a GPU too
    n_cls = 1024 // K
    a = torch.empty(32, 64, dtype=torch.bfloat16, device=META)
    w = torch.empty(1024, 64, device=META)
    tcol, tval = torch.empty(32, dtype=torch.int32, device=META), torch.empty(32, device=META)
    tr = torch.empty(32, 64, device=META) if filter_ else None
    stats = chunks.forward_stats(a, w, None, torch.empty(1024, device=META), tr, tcol, tval, n_cls, K, 4.0, 0.3, True,
                                 False, torch.empty(1024, 64, dtype=torch.bfloat16, device=META))
    assert chunks.chunk_classes(n_cls, 32, K, 64, 2, META) == n_cls  # one chunk
    assert stats[0].shape == (32, n_cls // tile)


def _regions_seen(run, **tensors):
    """What ``run`` tells the plan, each region as (tensor's name, part with tensors named, bytes,
    streamed); tensors named by their storage (a span is a view of the tensor it names)."""
    from shardfc.head.fused import traffic

    names = {t.untyped_storage().data_ptr(): name for name, t in tensors.items()}

    def named(r):
        part = tuple(names[x.untyped_storage().data_ptr()] if isinstance(x, torch.Tensor) else x for x in r.part)
        return names[r.tensor.untyped_storage().data_ptr()], part, r.nbytes, r.streamed

    seen = []
    with traffic.recording(lambda kernel, reads, writes, flops: seen.append(
            (kernel, [named(r) for r in reads], [named(w) for w in writes]))):
        run()
    return seen


def test_note_rows_of_the_sgd_update_of_partial_fc_rows():
    """One chunk's rows 4..7 (3 rows, D = 6, fp32) of the SGD update with momentum over Partial FC's
    rows: reads H's rows, the weight rows gathered, their norms and index rows, the weight and
    momentum rows (streamed) and the target slots; writes the weight and momentum rows."""
    t = dict(h=torch.zeros(10, 6), w=torch.zeros(20, 6), buf=torch.zeros(20, 6), inv=torch.zeros(10),
             rows=torch.arange(10), slot=torch.zeros(10, dtype=torch.int32), grad_w=torch.zeros(1, 6))
    update = chunks.RowUpdate(t["w"], t["buf"], 0.1, 0.9, 0.0, False)
    seen = _regions_seen(lambda: chunks._note_rows(update, t["h"], t["w"], t["rows"], t["inv"], t["rows"], t["grad_w"],
                                                   4, 3, False, True, t["slot"]), **t)
    state = [("w", ("rows", "rows", 4, 3), 72, True), ("buf", ("rows", "rows", 4, 3), 72, True)]
    assert seen == [("weight_update",
                     [("h", ("span", 0, 72), 72, False), ("w", ("rows", "rows", 4, 3), 72, False),
                      ("inv", ("span", 16, 12), 12, False), ("rows", ("span", 32, 24), 24, False)]
                     + state + [("slot", ("span", 16, 12), 12, False)],
                     state)]


def test_note_rows_of_the_adamw_update_writing_the_next_operand():
    """AdamW over every row (rows 2..5), reading the step's operand rows (not gathered) and writing
    the next step's operand rows and norms: the weight, both moments and the fp64 step counts
    streamed; with Partial FC's rows the step counts are gathered by them."""
    t = dict(h=torch.zeros(10, 6), op=torch.zeros(10, 6, dtype=torch.bfloat16), w=torch.zeros(10, 6),
             m=torch.zeros(10, 6), v=torch.zeros(10, 6), step=torch.zeros(10, dtype=torch.float64),
             inv=torch.zeros(10), slot=torch.zeros(10, dtype=torch.int32), rows=torch.arange(8),
             grad_w=torch.zeros(1, 6))
    update = chunks.RowUpdate.adamw(t["w"], t["m"], t["v"], t["step"], 0.1, (0.9, 0.99), 1e-8, 0.0)
    seen = _regions_seen(lambda: chunks._note_rows(update, t["h"], t["op"], None, t["inv"], None, t["grad_w"], 2, 4,
                                                   False, False, t["slot"], t["op"]), **t)
    state = [(name, ("span", 2 * 24, 96), 96, True) for name in ("w", "m", "v")] + [("step", ("span", 16, 32), 32, True)]
    assert seen == [("adamw_update",
                     [("h", ("span", 0, 96), 96, False), ("op", ("span", 24, 48), 48, False),
                      ("inv", ("span", 8, 16), 16, False)] + state + [("slot", ("span", 8, 16), 16, False)],
                     state + [("op", ("span", 24, 48), 48, False), ("inv", ("span", 8, 16), 16, False)])]
    seen = _regions_seen(lambda: chunks._note_rows(update, t["h"], t["w"], t["rows"], None, t["rows"], t["grad_w"], 2, 4,
                                                   False, False, t["slot"]), **t)
    assert seen[0][2] == [(name, ("rows", "rows", 2, 4), 96, True) for name in ("w", "m", "v")] + [
        ("step", ("rows", "rows", 2, 4), 32, True)]


@pytest.mark.parametrize("accumulate,scatter", [(False, False), (True, True), (True, False)])
def test_note_rows_of_the_weight_gradient(accumulate, scatter):
    """Without an update: the gradient rows written (streamed) at the scored rows, or at the weight
    rows through Partial FC's (``scatter``), and read first when added to (``accumulate``)."""
    t = dict(h=torch.zeros(10, 6), w=torch.zeros(20, 6), inv=torch.zeros(10), rows=torch.arange(10),
             grad_w=torch.zeros(20, 6))
    seen = _regions_seen(lambda: chunks._note_rows(None, t["h"], t["w"], t["rows"], t["inv"], t["rows"], t["grad_w"], 4, 3,
                                                   accumulate, scatter, None), **t)
    out = ("grad_w", ("rows", "rows", 4, 3) if scatter else ("span", 4 * 24, 72), 72, True)
    assert seen == [("weight_grad",
                     [("h", ("span", 0, 72), 72, False), ("w", ("rows", "rows", 4, 3), 72, False),
                      ("inv", ("span", 16, 12), 12, False), ("rows", ("span", 32, 24), 24, False)] + [out] * accumulate,
                     [out])]


def _backward_refusal(**kw):
    """``chunks.backward``'s checks of its options, made before anything is read: placeholders."""
    x = torch.zeros(2, 4)
    args = dict(n_cls=3, K=1, scale=1.0, threshold=0.0, eps_over_c=0.0, one_minus_eps=1.0, normalize=True,
                accumulate=False, scatter=False)
    args.update(kw)
    with pytest.raises(ValueError) as err:
        chunks.backward(x, x, args.pop("rows", None), args.pop("inv", torch.ones(3)), None, *[x[0]] * 8, x, **args)
    return str(err.value)


def test_backward_refuses_a_grad_sq_with_a_fused_update_and_a_next_operand_it_cannot_write():
    update = chunks.RowUpdate(torch.zeros(3, 4), None, 0.1, 0.0, 0.0, False)
    operand = torch.zeros(3, 4)
    assert _backward_refusal(grad_sq=torch.zeros(1), update=update) == "grad_sq is the stored gradient's: a fused update stores none"
    message = ("next_operand needs the fused update, every row scored, the step's operand and the norms exactly when "
               "the rows are normalised")
    assert _backward_refusal(next_operand=True, operand=operand) == message  # no update
    assert _backward_refusal(next_operand=True, update=update, operand=operand, rows=torch.arange(3)) == message
    assert _backward_refusal(next_operand=True, update=update) == message  # no operand
    assert _backward_refusal(next_operand=True, update=update, operand=operand, inv=None) == message  # normalised, no norms
    assert _backward_refusal(next_operand=True, update=update, operand=operand, normalize=False) == message  # norms, raw rows


def _meta_backward(n_cls=40, B=5, D=8, **kw):
    m = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device=META)  # noqa: E731
    i32 = torch.int32
    args = dict(n_cls=n_cls, K=1, scale=4.0, threshold=0.0, eps_over_c=0.0, one_minus_eps=1.0, normalize=True,
                accumulate=False, scatter=False, operand=m(n_cls, D))
    args.update(kw)
    return chunks.backward(m(B, D), m(n_cls, D), None, m(n_cls), None, m(B, dtype=i32), m(B), m(B, dtype=i32), m(B),
                           m(B, dtype=torch.bool), m(B), m(B), m(B), m(n_cls, D), **args)


@pytest.mark.parametrize("chunk_scale,chunk_rows", [(None, (16, 16, 8)), (2, (32, 8))])
def test_backward_on_the_meta_device_tells_the_plan_one_epilogue_and_one_row_pass_a_chunk(chunk_scale, chunk_rows):
    """``shardfc plan``'s backward: per chunk of 16 × the chunk scale classes, the epilogue over its
    products and the weight-gradient pass over its rows (no option left out: the defaults, the
    embeddings as given for the target rows); ``dJ/da`` on the meta device, fp32."""
    from shardfc.head.fused import traffic

    seen = []
    with traffic.recording(lambda kernel, reads, writes, flops: seen.append((kernel, writes[0].nbytes))):
        grad_a = _meta_backward(chunk_scale=chunk_scale)
    assert (grad_a.device, grad_a.dtype, tuple(grad_a.shape)) == (META, torch.float32, (5, 8))
    ours = [s for s in seen if s[0] in ("backward_epilogue", "weight_grad")]
    assert ours == [x for n in chunk_rows for x in (("backward_epilogue", 5 * n * 4), ("weight_grad", n * 8 * 4))]


@pytest.mark.parametrize("case", ["every_row", "partial_fc_added", "partial_fc_update", "partial_fc_operand_update"])
def test_backward_on_the_meta_device_reads_and_writes_what_its_options_say(case):
    """Per chunk of 16 classes (40 classes, bf16 compute): the epilogue reads the products, the rows'
    norms and four ``[B]`` vectors and rewrites the products; the row pass reads H, the normalised
    rows from the bf16 operand (every row scored) or the fp32 rows gathered (Partial FC), the norms,
    the index rows, and writes the gradient rows at the scored rows, or adds them at the weight rows
    (``accumulate``, ``scatter``), or with an update reads and writes the weight rows and reads the
    target slots (and writes no next operand unless asked)."""
    from shardfc.head.fused import traffic

    B, D, n = 5, 8, 40
    m = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device=META)  # noqa: E731
    rows = None if case == "every_row" else torch.arange(n, device=META)
    update = chunks.RowUpdate(m(60, D), None, 0.1, 0.0, 0.0, False) if case.endswith("update") else None
    has_operand = rows is None or case == "partial_fc_operand_update"
    kw = dict(accumulate=True, scatter=True) if case == "partial_fc_added" else dict(accumulate=False, scatter=False)
    seen = []
    with traffic.recording(lambda kernel, reads, writes, flops: seen.append(
            (kernel, [(r.part[0], r.nbytes) for r in reads], [(w.part[0], w.nbytes) for w in writes]))):
        chunks.backward(m(B, D, dtype=torch.bfloat16), m(60, D), rows, m(n), None, m(B, dtype=torch.int32), m(B),
                        m(B, dtype=torch.int32), m(B), m(B, dtype=torch.bool), m(B), m(B), m(B), m(60, D), n_cls=n, K=1,
                        scale=4.0, threshold=0.0, eps_over_c=0.0, one_minus_eps=1.0, normalize=True, a_exact=m(B, D),
                        operand=m(n, D, dtype=torch.bfloat16) if has_operand else None, update=update, **kw)
    epilogues = [s for s in seen if s[0] == "backward_epilogue"]
    assert epilogues == [("backward_epilogue", [("span", B * c * 2), ("span", c * 4)] + [("span", B * 4)] * 4,
                          [("span", B * c * 2)]) for c in (16, 16, 8)]
    passes = [s for s in seen if s[0] in ("weight_grad", "weight_update")]
    for (kernel, reads, writes), c in zip(passes, (16, 16, 8), strict=True):
        rows_read = [("span", c * D * 2)] if has_operand else [("rows", c * D * 4)]
        assert reads[:4] == [("span", c * D * 4)] + rows_read + [("span", c * 4)] + ([] if rows is None else [("span", c * 8)])
        if update is not None:
            assert kernel == "weight_update" and writes == [("rows", c * D * 4)] and reads[4:] == writes + [("span", c * 4)]
        else:
            out = ("rows", c * D * 4) if case == "partial_fc_added" else ("span", c * D * 4)
            assert kernel == "weight_grad" and writes == [out] and reads[4 - (rows is None):] == [out] * kw["accumulate"]
