"""The registered kernels compile for an H100 (sm_90) on this CPU machine (``shardfc.head.fused.aot``),
built with the divisibility hints the JIT gives them at run time and read back from the SASS with
the bundled ``cuobjdump``: every config of every kernel on the default path, and the other option
paths (each with the configs its launcher picks for them), fit the SM's shared memory and 255
registers and spill nothing; every
tensor-core dot lowers to Hopper's wgmma (``HGMMA``), never to the Ampere-style ``HMMA``. This is
what the interpreter, which runs the same code as numpy, cannot check. The build runs in a
subprocess: this test session runs the kernels under the interpreter, which cannot compile them.
(Figures as measured with Triton 3.9; a new compiler that spills more is worth knowing.)"""

from __future__ import annotations

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


def test_every_build_fits_an_h100_and_nothing_spills(built):
    problems = []
    for b in built:
        if not 0 <= b["shared"] <= aot.H100_SHARED_BYTES:
            problems.append(f"{_name(b)}: {b['shared']} bytes of shared memory (H100: {aot.H100_SHARED_BYTES})")
        if b["registers"] is None or b["registers"] > 255:
            problems.append(f"{_name(b)}: {b['registers']} registers per thread")
        if b["stack_bytes"] != 0 or b["local_ops"] != 0:
            problems.append(f"{_name(b)}: spills ({b['stack_bytes']} stack bytes, {b['local_ops']} LDL/STL)")
    assert not problems, "\n".join(problems)


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
