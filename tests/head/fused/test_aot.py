"""The registered kernels compile for an H100 (sm_90) on this CPU machine (``shardfc.head.fused.aot``),
built with the divisibility hints the JIT gives them at run time and read back from the SASS with
the bundled ``cuobjdump``: every config of every kernel on the default path, and the other option
paths (each with the configs its launcher picks for them), fit the SM's shared memory and 255
registers and spill nothing (but for :data:`TOLERATED_SPILLS`: one compiler release's save around a
loop, never inside one); every
tensor-core dot lowers to Hopper's wgmma (``HGMMA``), never to the Ampere-style ``HMMA``. This is
what the interpreter, which runs the same code as numpy, cannot check. The build runs in a
subprocess: this test session runs the kernels under the interpreter, which cannot compile them.
(Figures as measured with Triton 3.9, and 3.6, the GPU machine's; a new compiler that spills more is worth
knowing.)"""

from __future__ import annotations

import io
import json
import sys

import aot_build
import pytest
import triton
import triton.language as tl

from shardfc.head.fused import aot


@pytest.fixture(scope="module")
def built():
    """Every build, from the subprocess collection started (aot_build.py)."""
    return aot_build.result()


def _name(b: dict) -> str:
    return f"{b['kernel']} [{b['config']}] variant {b['variant']!r}"


def test_every_registered_config_and_variant_is_built(built):
    expected = {
        (variant, name, aot._label(config))
        for name, entry in aot.KERNELS.items()
        for variant in aot.VARIANTS
        if aot.variant_flags(name, variant) is not None
        for config in entry.configs_for(aot.variant_flags(name, variant))
    }
    got = [(b["variant"], b["kernel"], b["config"]) for b in built]
    assert sorted(got) == sorted(expected)
    assert {"lse_forward_kernel", "row_sgd_kernel", "operand_rows_kernel",
            "forward_epilogue_kernel", "backward_epilogue_kernel", "weight_grad_kernel"} <= set(aot.KERNELS)


#: Spills a Triton release's ptxas makes that no other config avoids without costing the hot path,
#: each outside every loop (one save before, one restore after): ``(Triton major.minor, kernel,
#: config, variant) -> (stack bytes, LDL+STL)`` at most, and why.
TOLERATED_SPILLS = {
    # Triton 3.6 (the GPU machine's): the 8-row AdamW update keeps one 64-bit row pointer in local
    # memory across its D loop — stored once before it, loaded once after (56 registers; 3.9 keeps
    # it in a register at 61). 8x128 or 2 warps avoid it at 96 registers, the 16-row tile's count.
    ("3.6", "adamw_update_kernel", "BRxBD 8x64 w4 s3", "default"): (8, 2),
}


def test_every_build_fits_an_h100_and_nothing_spills(built):
    problems = []
    version = ".".join(triton.__version__.split(".")[:2])
    for b in built:
        if not 0 <= b["shared"] <= aot.H100_SHARED_BYTES:
            problems.append(f"{_name(b)}: {b['shared']} bytes of shared memory (H100: {aot.H100_SHARED_BYTES})")
        if b["registers"] is None or b["registers"] > 255:
            problems.append(f"{_name(b)}: {b['registers']} registers per thread")
        if b["stack_bytes"] != 0 or b["local_ops"] != 0:
            stack, ops = TOLERATED_SPILLS.get((version, b["kernel"], b["config"], b["variant"]), (0, 0))
            if b["stack_bytes"] > stack or b["local_ops"] > ops or b["local_ops_in_loops"] != 0:
                problems.append(f"{_name(b)}: spills ({b['stack_bytes']} stack bytes, {b['local_ops']} LDL/STL, "
                                f"{b['local_ops_in_loops']} in loops)")
    assert not problems, "\n".join(problems)


_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL.64 [R1], R44 ;
        /*0020*/              @!P0 BRA 0x0090 ;
        /*0030*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0040*/                   STL [R1+0x8], R2 ;
        /*0050*/                   CALL.REL.NOINC 0x00c0 ;
        /*0060*/                   LDL R3, [R1+0x8] ;
        /*0070*/              @!P1 BRA 0x0030 ;
        /*0080*/                   LDL.LU.64 R12, [R1] ;
        /*0090*/                   EXIT ;
        /*00a0*/                   BRA 0x00a0 ;
        /*00b0*/                   NOP ;
        /*00c0*/                   STL [R1+0x10], R5 ;
        /*00d0*/                   RET.REL.NODEC R20 0x0 ;
"""


def test_local_ops_in_loops_counts_a_loop_body_and_the_subroutines_not_a_save_around_them():
    # the loop 0x30..0x70 holds an STL and an LDL, the subroutine at 0xc0 one STL; the save at 0x10 and
    # the restore at 0x80 run once (the forward branch at 0x20 and the self-branch at 0xa0, after EXIT, are no loop
    # that holds one)
    assert aot.local_ops_in_loops(_SASS) == 3
    assert aot.local_ops_in_loops(_SASS.replace("CALL.REL.NOINC 0x00c0", "NOP")) == 2
    assert aot.local_ops_in_loops(_SASS.replace("@!P1 BRA 0x0030", "NOP").replace("CALL.REL.NOINC 0x00c0", "NOP")) == 0
    # addresses and targets are both hexadecimal: a save at 0x0ff0, just before a loop from 0x1000
    save_before_a_loop = """
        /*0ff0*/                   STL.64 [R1], R44 ;
        /*1000*/                   FADD R2, R2, R3 ;
        /*1100*/              @!P1 BRA 0x1000 ;
        /*1110*/                   LDL.LU.64 R12, [R1] ;
"""
    assert aot.local_ops_in_loops(save_before_a_loop) == 0
    assert aot.local_ops_in_loops(save_before_a_loop.replace("FADD R2, R2, R3", "LDL R2, [R1+0x8]")) == 1


def test_tensor_core_dots_use_wgmma_never_mma_sync(built):
    problems = []
    for b in built:
        if b["hmma"]:
            problems.append(f"{_name(b)}: {b['hmma']} HMMA (mma.sync, Ampere-style) in its SASS; "
                            f"sm_90 wants HGMMA (wgmma: >= 64 rows per warpgroup)")
        if b["tc_dots"] and not b["hgmma"]:
            problems.append(f"{_name(b)}: {b['tc_dots']} tensor-core tl.dot but no HGMMA in its SASS")
        if not b["tc_dots"] and b["hgmma"]:
            problems.append(f"{_name(b)}: {b['hgmma']} HGMMA without a tensor-core tl.dot")
    assert not problems, "\n".join(problems)
    # The checks above are not vacuous: the forward multiplies on tensor cores except at fp32 IEEE.
    forward = [b for b in built if b["kernel"] == "lse_forward_kernel"]
    assert forward and all(b["dots"] > 0 for b in forward)
    assert all((b["tc_dots"] == 0) == (b["variant"] == "fp32-ieee") for b in forward)
    assert all(b["dots"] == 0 for b in built if b["kernel"] in ("operand_rows_kernel", "row_sgd_kernel"))


def test_the_builds_get_the_jit_hints(built):
    for b in built:
        if b["kernel"] == "lse_forward_kernel":
            assert {"D", "stride_a", "stride_w", "cls_per_split", "a_ptr", "w_ptr"} <= set(b["hinted"]), _name(b)
            assert not {"B", "n_cls", "n_splits"} & set(b["hinted"]), _name(b)
        if b["kernel"] == "row_sgd_kernel":
            assert {"D", "stride_p", "stride_b", "stride_g", "p_ptr", "idx_ptr"} <= set(b["hinted"]), _name(b)
            assert "n" not in b["hinted"], _name(b)


def test_sass_and_ir_are_read_as_expected():
    sass = """
        /*0c30*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4].tnspB, RZ, !UPT ;
        /*0c40*/              @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0c50*/                   STL.64 [R1+0x8], R2 ;
        /*0c60*/               @P1 LDL R3, [R1+0x8] ;
    """
    assert aot._OPCODE.findall(sass) == ["HGMMA", "HMMA", "STL", "LDL"]
    ttir = """
    %acc = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<128x32xbf16> * tensor<32x128xbf16> -> tensor<128x128xf32>
    %f = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<128x32xf32> * tensor<32x128xf32> -> tensor<128x128xf32>
    %g = tt.dot %a, %b, %c : tensor<64x64xf32> * tensor<64x64xf32> -> tensor<64x64xf32>
    %h = tt.dot %a, %b, %c, inputPrecision = ieee : tensor<64x64xf32> * tensor<64x64xf32> -> tensor<64x64xf32>
    """
    assert aot._dots(ttir) == (4, 2)


@triton.jit
def _undeclared_int_kernel(x_ptr, mystery_count, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), mystery_count)


def test_register_rejects_undecided_arguments_and_duplicates():
    with pytest.raises(ValueError, match="mystery_count.*neither aot.HINTED nor aot.UNHINTED"):
        aot.register(_undeclared_int_kernel, [triton.Config({"BLOCK": 128})], {})
    with pytest.raises(ValueError, match="BLOCK"):
        aot.register(_undeclared_int_kernel, [triton.Config({})], {}, types={"mystery_count": "fp32"})
    assert "_undeclared_int_kernel" not in aot.KERNELS
    with pytest.raises(ValueError, match="already registered"):
        sgd = aot.KERNELS["row_sgd_kernel"]
        aot.register(sgd.fn, sgd.configs, sgd.flags, sgd.types)
    assert aot.KERNELS["row_sgd_kernel"] is sgd


def test_class_splits_are_whole_tiles_of_every_forward_config():
    """A split of the forward's classes is a multiple of SPLIT_QUANTUM so that every autotune
    config tiles it exactly; the wide 128×256 tile (added after the first H200 run) raised it to 256."""
    from shardfc.head.fused import autotune

    configs = autotune.FORWARD_CONFIGS + autotune.WIDE_FORWARD_CONFIGS + autotune.HEAVY_FORWARD_CONFIGS
    assert all(autotune.SPLIT_QUANTUM % c.kwargs["BN"] == 0 for c in configs)
    assert all(c in autotune.forward_configs(1, False) for c in autotune.WIDE_FORWARD_CONFIGS)
    # the wide tiles are for the bf16/fp16 operand only: not the fp32 rows (norm_w), the filter or fp32 IEEE
    for kwargs in (dict(norm_w=True), dict(precision="ieee")):
        assert not any(c in autotune.forward_configs(1, False, **kwargs) for c in autotune.WIDE_FORWARD_CONFIGS)
    assert autotune.forward_configs(1, True) == autotune.HEAVY_FORWARD_CONFIGS[:1]


# --- In-process builds of small kernels (what the subprocess build above does, seen by the test) ---
#
# The build above runs in a subprocess (this session's kernels are the interpreter's), so neither
# coverage nor mutation testing sees compile_one, _sass, build_all or main run. These kernels are
# wrapped by triton.jit with the interpreter off, registered in a copy of the registry, and built for
# sm_90 here with the bundled ptxas and cuobjdump (about a second each, cached by Triton after).


def _scale_rows(x_ptr, out_ptr, n, D, stride_x, scale, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i * stride_x + cols, mask=(cols < D) & (i < n))
    if SCALE:
        x = x * scale
    tl.store(out_ptr + i * stride_x + cols, x, mask=cols < D)


def _tile_product(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  COMPUTE: tl.constexpr, PRECISION: tl.constexpr, K: tl.constexpr):
    # min(K, 3) products of the same tiles summed: as many tt.dot ops in its IR, so a build shows K
    r, c, k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    a = tl.load(a_ptr + r[:, None] * BK + k[None, :])
    b = tl.load(b_ptr + k[:, None] * BN + c[None, :])
    acc = tl.dot(a, b, input_precision=PRECISION)
    if K > 1:
        acc += tl.dot(a, b, input_precision=PRECISION)
    if K > 2:
        acc += tl.dot(a, b, input_precision=PRECISION)
    tl.store(c_ptr + r[:, None] * BN + c[None, :], acc)


# Triton's interpreter patches triton.language (builtins, tensor methods, range, ...) for each kernel it
# runs and restores it afterwards, but not after a @jit helper called from a kernel (Triton 3.9's
# InterpretedFunction.__call__): a compile after such a run reads the interpreter's stand-ins and fails.
# The language as it was when this module was imported (before any test ran a kernel) is put back
# before each in-process build.
_LANGUAGE = [ns for ns in (tl, tl.core, getattr(tl, "math", None), tl.core.tensor, getattr(tl.core, "condition", None),
                           tl.core.dtype, getattr(tl.core, "tensor_descriptor_base", None)) if ns is not None]
_PRISTINE = [(ns, dict(vars(ns))) for ns in _LANGUAGE]


def _unpatch_language() -> None:
    for ns, before in _PRISTINE:
        now = vars(ns)
        for name in [n for n in now if n not in before]:
            delattr(ns, name)
        for name, value in before.items():
            if now.get(name, before) is not value:
                setattr(ns, name, value)


_ROWS_CONFIG = triton.Config({"BLOCK": 512})
_TILE_CONFIGS = [triton.Config({"BM": 64, "BN": 64, "BK": 32}),
                 triton.Config({"BM": 64, "BN": 128, "BK": 32}, num_warps=8, num_stages=2)]
_TILE_LABELS = ["BMxBNxBK 64x64x32 w4 s3", "BMxBNxBK 64x128x32 w8 s2"]
_TILE_FLAGS = {"COMPUTE": tl.bfloat16, "PRECISION": "tf32", "K": 1}


@pytest.fixture
def registry(monkeypatch):
    """The registry with two compiled (not interpreted) kernels added: "rows" and "tiles"."""
    _unpatch_language()
    monkeypatch.setattr(aot, "KERNELS", dict(aot.KERNELS))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # as the subprocess build (aot_build.py): Triton 3.9 warns
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")  # triton.jit reads it when it wraps
        scale_rows, tile_product = triton.jit(_scale_rows), triton.jit(_tile_product)
    rows = aot.register(scale_rows, [_ROWS_CONFIG], {"SCALE": True}, name="rows")
    tiles = aot.register(tile_product, _TILE_CONFIGS, _TILE_FLAGS, name="tiles",
                         types={"a_ptr": aot.COMPUTE_PTR, "b_ptr": aot.COMPUTE_PTR})
    assert type(rows.fn).__name__ == "JITFunction"
    return rows, tiles


@pytest.fixture
def only_these(registry, monkeypatch):
    """The registry holding the two small kernels alone (what a run without --kernels builds)."""
    monkeypatch.setattr(aot, "KERNELS", {"rows": registry[0], "tiles": registry[1]})
    return registry


@pytest.fixture
def compiled(monkeypatch):
    """The kernels triton.compile returns, in order (their IR and metadata)."""
    real, got = triton.compile, []

    def keep(*args, **kwargs):
        got.append(real(*args, **kwargs))
        return got[-1]

    monkeypatch.setattr(triton, "compile", keep)
    return got


def test_the_signature_types_each_argument_by_its_name_or_entry(registry):
    rows, tiles = registry
    assert aot._signature(rows, rows.flags) == {
        "x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "D": "i32", "stride_x": "i32", "scale": "fp32",
        "BLOCK": "constexpr", "SCALE": "constexpr"}
    for compute, name in ((tl.bfloat16, "bf16"), (tl.float16, "fp16"), (tl.float32, "fp32")):
        sig = aot._signature(tiles, {**_TILE_FLAGS, "COMPUTE": compute})
        assert sig == {"a_ptr": "*" + name, "b_ptr": "*" + name, "c_ptr": "*fp32", "BM": "constexpr",
                       "BN": "constexpr", "BK": "constexpr", "COMPUTE": "constexpr", "PRECISION": "constexpr",
                       "K": "constexpr"}
    typed = aot.Entry(rows.fn, [_ROWS_CONFIG], rows.flags, {"x_ptr": "*i64", "n": "u32"})
    sig = aot._signature(typed, rows.flags)
    assert (sig["x_ptr"], sig["n"], sig["out_ptr"]) == ("*i64", "u32", "*fp32")


def test_hints_go_to_pointers_and_to_the_listed_integers_by_the_width():
    sig = {"x_ptr": "*fp32", "idx_ptr": "*i64", "D": "i32", "stride_x": "i32", "stride_w": "i32", "c0": "i32",
           "cls_per_split": "i32", "n": "i32", "B": "i32", "scale": "fp32", "BLOCK": "constexpr", "lr": "fp32"}
    assert aot._hinted(sig, 512) == ["x_ptr", "idx_ptr", "D", "stride_x", "stride_w", "c0", "cls_per_split"]
    # D and the strides are multiples of 16 only when the width is; the chunk's first class always is
    for dim in (500, 8, 24):
        assert aot._hinted(sig, dim) == ["x_ptr", "idx_ptr", "c0", "cls_per_split"]
    assert aot._hinted(sig, 16) == aot._hinted(sig, 512)
    # a hinted name whose type is not i32 (a float, a u32) is not an integer to hint
    assert aot._hinted({"D": "fp32", "c0": "u32", "x_ptr": "*bf16"}, 512) == ["x_ptr"]
    assert aot._hint_key("stride_anything") == "stride_*" and aot._hint_key("xstride_a") == "xstride_a"


def _hints_in(kernel) -> list:
    """The argument names the compiled kernel's IR marks ``tt.divisibility = 16``."""
    head = next(line for line in kernel.asm["ttir"].splitlines() if "tt.func" in line)
    args = head.split("(", 1)[1].split(", %")
    return [arg.split(":")[0].strip(" %") for arg in args if "tt.divisibility = 16 " in arg]


def test_a_build_reads_back_registers_hints_and_instructions(registry, compiled):
    built = aot.compile_one("rows", _ROWS_CONFIG, {"SCALE": True})
    assert (built.kernel, built.config, built.hinted) == ("rows", "BLOCK 512 w4 s3", ["x_ptr", "out_ptr", "D", "stride_x"])
    assert 0 < built.registers <= 255 and built.stack_bytes == 0 and built.local_ops == 0
    assert (built.hgmma, built.hmma, built.dots, built.tc_dots) == (0, 0, 0, 0)
    # the hints are the compiler's, not only the record's
    assert _hints_in(compiled[-1]) == ["x_ptr", "out_ptr", "D", "stride_x"]
    assert aot.compile_one("rows", _ROWS_CONFIG, {"SCALE": True}, dim=500).hinted == ["x_ptr", "out_ptr"]
    assert _hints_in(compiled[-1]) == ["x_ptr", "out_ptr"]

    # a bf16 product: shared memory for its operands, wgmma on sm_90, mma.sync on sm_80
    sm90 = aot.compile_one("tiles", _TILE_CONFIGS[0], _TILE_FLAGS)
    assert sm90.config == _TILE_LABELS[0]
    assert sm90.shared > 0 and (sm90.dots, sm90.tc_dots) == (1, 1)
    assert sm90.hgmma > 0 and sm90.hmma == 0
    target = compiled[-1].metadata.target
    assert (target.backend, target.arch, target.warp_size) == ("cuda", 90, 32)
    sm80 = aot.compile_one("tiles", _TILE_CONFIGS[0], _TILE_FLAGS, capability=80)
    assert sm80.hgmma == 0 and sm80.hmma > 0 and compiled[-1].metadata.target.arch == 80
    # fp32 at IEEE precision: no tensor core at all; K products: K dots
    ieee = aot.compile_one("tiles", _TILE_CONFIGS[0], {**_TILE_FLAGS, "COMPUTE": tl.float32, "PRECISION": "ieee"})
    assert (ieee.dots, ieee.tc_dots, ieee.hgmma, ieee.hmma) == (1, 0, 0, 0)
    assert aot.compile_one("tiles", _TILE_CONFIGS[0], {**_TILE_FLAGS, "K": 3}).dots == 3
    # the config's warps and stages reach the compiler
    for config, label in zip(_TILE_CONFIGS, _TILE_LABELS):
        assert aot.compile_one("tiles", config, _TILE_FLAGS).config == label
        meta = compiled[-1].metadata
        assert (meta.num_warps, meta.num_stages) == (config.num_warps, config.num_stages)


def test_the_sass_reader_refuses_what_cuobjdump_does_not_give(monkeypatch, tmp_path):
    with pytest.raises(RuntimeError, match=r"^cuobjdump failed: .+"):
        aot._sass(b"not a cubin")
    tool = tmp_path / "cuobjdump"
    monkeypatch.setattr(aot, "_TOOLS", str(tmp_path))

    def prints(text: str, code: int = 0) -> None:
        tool.write_text(f"#!/bin/sh\ncat <<'END'\n{text}\nEND\necho 'the tool said why' >&2\nexit {code}\n")
        tool.chmod(0o755)

    prints("Resource usage:\n Function k:\n  REG:40 STACK:16 SHARED:0", code=0)
    with pytest.raises(RuntimeError, match="^cuobjdump printed no SASS$"):
        aot._sass(b"")
    prints("        /*0010*/  HGMMA.64x64x16 R0 ;", code=3)
    with pytest.raises(RuntimeError, match="^cuobjdump failed: the tool said why$"):
        aot._sass(b"")
    prints("REG:40 STACK:16\n  /*0010*/  HGMMA.64x64x16 R0 ;\n  /*0020*/  STL [R1], R2 ;\n  /*0030*/  LDL R3, [R1] ;"
           "\n  /*0040*/  HGMMA.64x64x16 R0 ;")
    assert aot._sass(b"") == dict(registers=40, stack_bytes=16, hgmma=2, hmma=0, local_ops=2, local_ops_in_loops=0)
    prints("REG:40 STACK:16\n  /*0010*/  STL [R1], R2 ;\n  /*0020*/  LDL R3, [R1] ;\n  /*0030*/  @P0 BRA 0x0010 ;")
    assert aot._sass(b"")["local_ops_in_loops"] == 2
    prints("  /*0010*/  HMMA.16816 R0 ;")
    assert aot._sass(b"") == dict(registers=None, stack_bytes=None, hgmma=0, hmma=1, local_ops=0, local_ops_in_loops=0)


def test_the_sass_reader_leaves_no_file_behind(registry, compiled, monkeypatch, tmp_path):
    aot.compile_one("rows", _ROWS_CONFIG, {"SCALE": True})
    monkeypatch.chdir(tmp_path)
    assert aot._sass(compiled[-1].asm["cubin"])["registers"] > 0
    assert list(tmp_path.iterdir()) == []


def test_the_ir_reader_counts_tensor_core_dots_by_operand_and_precision():
    def dot(operand: str, precision: str = "") -> str:
        said = f", inputPrecision = {precision}" if precision else ""
        return f"%d = tt.dot %a, %b, %c{said} : tensor<64x32x{operand}> * tensor<32x64x{operand}> -> tensor<64x64xf32>\n"

    assert aot._dots(dot("f32", "ieee")) == (1, 0)
    assert aot._dots(dot("f32")) == (1, 0)  # no precision said: what the IR prints for IEEE
    assert aot._dots(dot("f32", "tf32")) == (1, 1)
    assert aot._dots(dot("f32", "tf32x3")) == (1, 1)
    assert aot._dots(dot("bf16", "ieee") + dot("f16")) == (2, 2)
    assert aot._dots("%x = tt.dot_scaled %a\n" + "tt.load\n") == (0, 0)


def test_build_all_builds_each_variant_that_touches_a_kernel(registry):
    built = list(aot.build_all(variants=("default", "raw-centres", "fp32-ieee", "smoothing+subcenters3"),
                               kernels=["rows", "tiles"]))
    assert [(b["variant"], b["kernel"], b["config"], b["dots"]) for b in built] == [
        ("default", "rows", "BLOCK 512 w4 s3", 0),
        ("default", "tiles", _TILE_LABELS[0], 1), ("default", "tiles", _TILE_LABELS[1], 1),
        ("raw-centres", "rows", "BLOCK 512 w4 s3", 0),  # SCALE=False
        ("fp32-ieee", "tiles", _TILE_LABELS[0], 1), ("fp32-ieee", "tiles", _TILE_LABELS[1], 1),
        ("smoothing+subcenters3", "tiles", _TILE_LABELS[0], 3), ("smoothing+subcenters3", "tiles", _TILE_LABELS[1], 3)]
    assert all(b["tc_dots"] == 0 and b["hgmma"] == 0 for b in built if b["variant"] == "fp32-ieee")
    keys = {f.name for f in aot.dataclasses.fields(aot.Built)} | {"variant"}
    assert all(set(b) == keys for b in built)
    first = [(b["variant"], b["config"]) for b in aot.build_all(variants=("default", "fp32-ieee"), kernels=["tiles"],
                                                               all_configs=False)]
    assert first == [("default", _TILE_LABELS[0]), ("default", _TILE_LABELS[1]), ("fp32-ieee", _TILE_LABELS[0])]
    # K reaches the kernels that take one (above, K=1 unless a variant sets it)
    assert [b["dots"] for b in aot.build_all(K=2, kernels=["tiles"])] == [2, 2]
    # a launcher's pick decides the configs of each variant's flags, as at run time
    aot.KERNELS["picked"] = aot.Entry(registry[1].fn, _TILE_CONFIGS, _TILE_FLAGS, registry[1].types,
                                      pick=lambda f: _TILE_CONFIGS[:1] if f["COMPUTE"] == tl.float32 else _TILE_CONFIGS[1:])
    assert [(b["variant"], b["config"]) for b in aot.build_all(variants=("default", "fp32-ieee"), kernels=["picked"])] == [
        ("default", _TILE_LABELS[1]), ("fp32-ieee", _TILE_LABELS[0])]


def test_variant_flags_overlay_what_a_kernel_takes_and_k_only_where_it_has_one(registry):
    assert aot.variant_flags("rows", "default") == {"SCALE": True}
    assert aot.variant_flags("rows", "raw-centres") == {"SCALE": False}
    assert aot.variant_flags("rows", "fp32-ieee") is None
    assert aot.variant_flags("rows", "default", K=3) == {"SCALE": True}  # no K: none added
    assert aot.variant_flags("tiles", "default") == _TILE_FLAGS  # K=1 unless asked
    forward = aot.KERNELS["lse_forward_kernel"].flags
    assert aot.variant_flags("lse_forward_kernel", "default", K=3) == {**forward, "K": 3}
    assert aot.variant_flags("lse_forward_kernel", "smoothing+subcenters3") == {**forward, "SMOOTH": True, "K": 3}
    # a variant is built only when it changes something: K=3 already, SMOOTH alone changes
    assert aot.variant_flags("lse_forward_kernel", "smoothing+subcenters3", K=3) == {**forward, "SMOOTH": True, "K": 3}
    assert aot.variant_flags("forward_epilogue_kernel", "large-shard-chunk-operand") is None


def test_configs_for_uses_the_launchers_pick_when_it_has_one(registry):
    rows, tiles = registry
    assert rows.configs_for({"SCALE": False}) == [_ROWS_CONFIG]
    picked = aot.Entry(tiles.fn, _TILE_CONFIGS, _TILE_FLAGS, pick=lambda f: _TILE_CONFIGS[1:] if f["COMPUTE"] == tl.float32 else [])
    assert picked.configs_for({"COMPUTE": tl.float32}) == _TILE_CONFIGS[1:]
    assert picked.configs_for(_TILE_FLAGS) == []
    assert aot._constexprs(rows.fn) == {"BLOCK", "SCALE"}
    assert aot._label(triton.Config({"BR": 32, "BD": 128}, num_warps=2, num_stages=4)) == "BRxBD 32x128 w2 s4"


def test_the_row_kernels_are_built_at_the_launchers_widest_tile_and_its_fewest_rows():
    from shardfc.head.fused import chunks

    wide, few = aot._row_configs((32, 128))
    assert (wide.kwargs, wide.num_warps, wide.num_stages) == ({"BR": 32, "BD": 128}, 4, 3)
    assert (few.kwargs, few.num_warps, few.num_stages) == ({"BR": chunks.MIN_ROW_TILE, "BD": 128}, 4, 3)
    assert chunks.MIN_ROW_TILE < 32
    assert [c.kwargs for c in aot._row_configs((chunks.MIN_ROW_TILE, 64))] == [{"BR": chunks.MIN_ROW_TILE, "BD": 64}]
    br, bd = chunks.ROW_TILES
    assert [aot._label(c) for c in aot.KERNELS["operand_rows_kernel"].configs] == [
        f"BRxBD {br}x{bd} w4 s3", f"BRxBD {chunks.MIN_ROW_TILE}x{bd} w4 s3"]


def test_register_names_every_problem_at_once(registry):
    rows, tiles = registry
    with pytest.raises(ValueError) as caught:
        aot.register(rows.fn, [], {"SCALE": True, "n": 3}, types={"y_ptr": "*fp32"}, name="rows")
    assert str(caught.value) == (
        "aot.register(rows): types names 'y_ptr', not an argument; flags name 'n', not a constexpr argument; "
        "constexpr 'BLOCK' is in neither flags nor the configs; no configs; already registered")
    assert aot.KERNELS["rows"] is rows
    # an integer typed as something else needs no hint decision; typed i32, it does
    block = [triton.Config({"BLOCK": 128})]
    with pytest.raises(ValueError) as caught:
        aot.register(_undeclared_int_kernel, block, {}, types={"mystery_count": "i32"})
    assert str(caught.value) == ("aot.register(_undeclared_int_kernel): integer 'mystery_count' is in neither "
                                 "aot.HINTED nor aot.UNHINTED (is it a multiple of 16 at run time?)")
    assert aot.register(_undeclared_int_kernel, block, {}, types={"mystery_count": "u32"}, name="u32").types == {
        "mystery_count": "u32"}
    entry = aot.register(rows.fn, [_ROWS_CONFIG], {"SCALE": True}, types={"x_ptr": "*i64"})
    assert aot.KERNELS["_scale_rows"] is entry and entry.types == {"x_ptr": "*i64"} and entry.pick is None
    pick = lambda flags: _TILE_CONFIGS[:1]  # noqa: E731
    assert aot.register(tiles.fn, _TILE_CONFIGS, _TILE_FLAGS, name="picked", pick=pick).pick is pick


class _Flushes(io.StringIO):
    """stdout that counts its flushes: a row reaches a pipe as soon as it is built."""

    flushes = 0

    def flush(self):
        self.flushes += 1
        super().flush()


def test_the_command_prints_a_table_or_json_and_fails_past_the_shared_memory(only_these, monkeypatch, capsys):
    assert aot.main(["--kernels", "rows", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == list(aot.build_all(kernels=["rows"]))

    assert aot.main(["--kernels", "tiles,rows", "--variants", "default,fp32-ieee", "--first-config",
                     "--subcenters", "1", "--dim", "500"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("sm_90, D=500, K=1; hinted: pointers, " + ", ".join(sorted(aot.HINTED)) + "; unhinted: "
                      + ", ".join(sorted(aot.UNHINTED)))
    assert out[1:3] == ["| variant | kernel | tiles, warps, stages | shared KB | registers | stack bytes | LDL+STL "
                        "(in loops) | tensor-core dots | HGMMA | HMMA |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = [line.split(" | ") for line in out[3:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("| default", "tiles", _TILE_LABELS[0]), ("| default", "tiles", _TILE_LABELS[1]),
        ("| default", "rows", "BLOCK 512 w4 s3"), ("| fp32-ieee", "tiles", _TILE_LABELS[0])]
    b = aot.compile_one("tiles", _TILE_CONFIGS[0], _TILE_FLAGS, dim=500)
    assert out[3] == (f"| default | tiles | {b.config} | {b.shared / 1024:.0f} | {b.registers} | {b.stack_bytes} "
                      f"| {b.local_ops} ({b.local_ops_in_loops}) | {b.tc_dots}/{b.dots} | {b.hgmma} | {b.hmma} |")

    # the largest build's shared memory decides (rows: none): exactly at the limit passes, a byte over fails
    assert aot.compile_one("rows", _ROWS_CONFIG, {"SCALE": True}).shared == 0
    monkeypatch.setattr(aot, "H100_SHARED_BYTES", 0)
    assert aot.main(["--kernels", "rows", "--json"]) == 0
    monkeypatch.setattr(aot, "H100_SHARED_BYTES", -1)
    assert aot.main(["--kernels", "rows", "--json"]) == 1
    monkeypatch.setattr(aot, "H100_SHARED_BYTES", b.shared - 1)
    assert aot.main(["--kernels", "tiles", "--variants", "fp32-ieee", "--first-config", "--json"]) == 1
    capsys.readouterr()

    # each row is flushed as it is printed (the whole build takes minutes), in either form
    for form in (["--json"], []):
        monkeypatch.setattr("sys.stdout", _Flushes())
        aot.main(["--kernels", "rows", *form])
        assert sys.stdout.flushes == 1


def test_the_command_builds_what_its_options_ask(only_these, monkeypatch, capsys, tmp_path):
    # a cache of its own: Triton's on-disk cache keys a build by its constexprs' text, so a K of "2"
    # (an option not converted to int) would be served the build of K = 2 instead of failing
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))

    def run(*argv: str) -> list:
        assert aot.main([*argv, "--json"]) == 0
        return [(b["variant"], b["kernel"], b["config"], b["dots"]) for b in map(json.loads, capsys.readouterr().out.splitlines())]

    # without --kernels every registered kernel; "all": every variant that touches one
    monkeypatch.setattr(aot, "KERNELS", {"rows": only_these[0]})
    assert run("--variants", "all") == [("default", "rows", "BLOCK 512 w4 s3", 0), ("raw-centres", "rows", "BLOCK 512 w4 s3", 0)]
    monkeypatch.setattr(aot, "KERNELS", {"tiles": only_these[1]})
    # every config of a variant unless --first-config; K from --subcenters (1 unless given)
    assert run("--variants", "fp32-ieee") == [("fp32-ieee", "tiles", label, 1) for label in _TILE_LABELS]
    assert run("--variants", "fp32-ieee", "--first-config", "--subcenters", "2") == [("fp32-ieee", "tiles", _TILE_LABELS[0], 2)]
    assert aot.main(["--capability", "80", "--variants", "fp32-ieee", "--first-config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"variant": "fp32-ieee", **aot.dataclasses.asdict(
        aot.compile_one("tiles", _TILE_CONFIGS[0], {**_TILE_FLAGS, "COMPUTE": tl.float32, "PRECISION": "ieee"}, capability=80))}


def test_the_command_documents_each_option(monkeypatch):
    parsers = []

    def stop(parser, argv=None, namespace=None):
        parsers.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(aot.argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(SystemExit):
        aot.main([])
    (p,) = parsers
    assert p.prog == "python -m shardfc.head.fused.aot" and p.description == aot.__doc__.splitlines()[0]
    assert {a.dest: (a.default, a.type, a.help) for a in p._actions if a.dest != "help"} == {
        "dim": (aot.DIM, int, "embedding width: D and the strides are hinted when it is a multiple of 16"),
        "subcenters": (1, int, "sub-centres per class (K) of the kernels that take one"),
        "capability": (90, int, "compute capability x10 (90: H100/H200)"),
        "variants": ("default", None, f"comma-separated, of {list(aot.VARIANTS)}, or 'all'"),
        "kernels": (None, None, f"comma-separated, of {list(aot.KERNELS)} (default: all)"),
        "first_config": (False, None, "beyond the default variant, only each kernel's first config"),
        "json": (False, None, "one JSON object per line instead of a table"),
    }


@pytest.mark.parametrize("argv, message", [
    (["--variants", "default,fast"], "--variants: 'fast' is not one of ["),
    (["--kernels", "rows,nope"], "--kernels: 'nope' is not one of ["),
])
def test_the_command_refuses_an_unknown_variant_or_kernel(registry, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        aot.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "python -m shardfc.head.fused.aot: error:" in err
    assert ("'rows'" in err) == ("--kernels" in message)
