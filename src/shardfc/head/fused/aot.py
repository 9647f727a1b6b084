"""Compile the fused kernels for a GPU without one: shared memory, registers, spills, tensor-core instructions.

Triton compiles ahead of time for any target (``GPUTarget("cuda", 90, 32)``: an H100) with the
``ptxas`` its wheel bundles, so a CPU machine can build every config of every registered kernel
(:data:`KERNELS`) and read the binary back with the wheel's ``cuobjdump`` — what the interpreter,
which runs the kernels as numpy, cannot tell. ``python -m shardfc.head.fused.aot`` prints a table
(``--json``: one object per build); ``tests/head/fused/test_aot.py`` checks it.

What is built is what the JIT would build at run time, as far as the arguments' values are known:

* **Specialisation hints.** At launch the JIT compiles with ``tt.divisibility = 16`` on every
  pointer that is 16-byte aligned and every integer whose value is a multiple of 16 (and turns an
  integer equal to 1 into a constant, which is ignored here). Those hints decide how wide the loads
  are and how the operands are staged through shared memory, so registers, shared memory and
  spills of a build without them describe a binary that never runs. The builds here get the hints the realistic workload gives
  (D = 512, contiguous rows, class splits in multiples of 128): every pointer, and the integers
  :data:`HINTED` lists; the integers :data:`UNHINTED` lists can be anything at run time and get no
  hint — the conservative binary (the JIT hints them too when they happen to be multiples of 16,
  e.g. B = 1024). This is what ``triton/tools/compile.py`` does with its ``:16`` signature suffix.
* **Per build** (:class:`Built`): shared memory (from the compiler's metadata), registers and stack
  bytes per thread (``cuobjdump --dump-resource-usage``), and from the SASS (``cuobjdump -sass``)
  the count of ``HGMMA`` (Hopper warpgroup MMA, wgmma), ``HMMA`` (the Ampere-style ``mma.sync``,
  which on sm_90 runs at a fraction of wgmma's rate) and ``LDL``/``STL`` (local-memory loads and
  stores: spilled registers); ``tc_dots`` counts the ``tt.dot`` ops of the Triton IR that ask for
  tensor cores (bf16/fp16 operands, or fp32 at tf32), ``dots`` all of them.

The test asserts, for sm_90: every build fits the SM's shared memory and 255 registers; the
default path spills nothing (stack 0, no ``LDL``/``STL``; ``local_ops_in_loops`` counts those that
would run per iteration, and the test's few named exceptions of one compiler release must have
none); every build with a tensor-core dot uses ``HGMMA`` and no ``HMMA``; builds without one (fp32
at IEEE precision, the row kernels) use neither.

Adding a kernel is one :func:`register` call (see there).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shardfc.head.fused import autotune, chunks, draw, epilogue, forward, idle_rows, optimizer

#: Shared memory an H100 SM grants one block (227 KB).
H100_SHARED_BYTES = 232448
#: The embedding width the default builds assume (``--dim``).
DIM = 512

# --- Signature: the Triton type of each run-time argument --------------------------------------
#
# By name: ``*_ptr`` is a pointer (``*fp32`` unless the kernel's entry types it), a name in
# FLOAT_ARGS an ``fp32`` scalar (Python floats), anything else an ``i32`` (Python ints below 2**31).
# A pointer typed COMPUTE_PTR points at the compute dtype (the ``COMPUTE`` flag of the build).

FLOAT_ARGS = {"scale", "threshold", "eps_over_c", "one_minus_eps", "unit", "lr", "momentum", "weight_decay", "decay",
              "beta1_hi", "beta1_lo", "beta2_hi", "beta2_lo", "one_minus_beta1", "one_minus_beta2", "eps"}
COMPUTE_PTR = "*COMPUTE"
_DTYPES = {tl.bfloat16: "bf16", tl.float16: "fp16", tl.float32: "fp32"}

# --- Divisibility hints: which integer arguments are built as multiples of 16 -----------------
#
# Every pointer is hinted: the arguments are torch allocations (256-byte aligned) or contiguous
# views of them starting at a row of D = 512 elements. An integer argument must be in exactly one
# of the two tables (register() checks), so a new kernel's arguments are decided, not defaulted.
# ``stride_*`` covers every argument so named.

#: Integer arguments hinted ``tt.divisibility = 16``, and why they are multiples of 16 at run time.
#: Those marked ``"D"`` are hinted only when ``--dim`` is a multiple of 16 (as the JIT would).
HINTED: Dict[str, str] = {
    "D": "D: the embedding width, 512",
    "stride_*": "D: row stride of a contiguous [rows, D] tensor (0 for an absent momentum buffer, also a multiple)",
    "cls_per_split": "classes per split: a multiple of autotune.SPLIT_QUANTUM (128) on a GPU",
    "cls_per_prog": "classes per forward-epilogue program: a multiple of its BN (128)",
    "c0": "the chunk's first class: a multiple of chunks.CHUNK_QUANTUM (128)",
    "r0": "the chunk's first centre row: c0 * K, a multiple of 128",
}
#: Integer arguments left unhinted: any value at run time, so the conservative binary.
UNHINTED: Dict[str, str] = {
    "B": "the batch: any size (the JIT hints 1024 but not 1000; unhinted is the binary that serves both)",
    "n_cls": "classes of the shard: C / world size, any count",
    "n_splits": "class splits: n_cls / cls_per_split rounded up, any count",
    "n_rows": "scored centre rows: n_cls * K, any count",
    "n": "rows updated: the rows sampled this step, any count",
    "n_c": "classes in a chunk: chunks.chunk_classes() (a multiple of 128) except the last chunk's",
    "part0": "the chunk's first column of the forward's partial statistics: any",
    "n_parts": "columns of the forward's partial statistics: any count",
    "last": "the idle rows' table entry of now: the steps since the table last restarted, any count",
    "iterate": "AdamW's missed steps iterated at most: adamw_exact_steps(), any count",
    "cls_bucket": "autotune key only (not read by the kernel): n_cls rounded up to a power of two, maybe < 16",
    "batch_bucket": "autotune key only (not read by the kernel): B rounded up to a power of two, maybe < 16",
}


def _constexprs(fn) -> set:
    """The ``tl.constexpr`` arguments of a ``@triton.jit`` function (compiled or interpreted)."""
    params = inspect.signature(fn.fn).parameters.values()
    return {p.name for p in params if "constexpr" in str(p.annotation)}


def _hint_key(name: str) -> str:
    return "stride_*" if name.startswith("stride_") else name


# --- The registry -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One kernel to build: ``fn`` at each of ``configs`` with the constexpr ``flags`` of its
    default path; ``types`` the arguments whose Triton type the naming rule above does not give."""

    fn: Any
    configs: Sequence[triton.Config]
    flags: Mapping[str, Any]
    types: Mapping[str, str] = field(default_factory=dict)
    #: The configs the launcher uses for a build's flags (None: all of ``configs``).
    pick: Optional[Callable[[Mapping[str, Any]], Sequence[triton.Config]]] = None

    def configs_for(self, flags: Mapping[str, Any]) -> Sequence[triton.Config]:
        """The configs a run with ``flags`` uses (none: the launcher never runs it so)."""
        return self.configs if self.pick is None else self.pick(flags)


#: Every kernel the AOT build covers, by name.
KERNELS: Dict[str, Entry] = {}


def register(fn, configs: Sequence[triton.Config], flags: Mapping[str, Any],
             types: Optional[Mapping[str, str]] = None, name: Optional[str] = None,
             pick: Optional[Callable[[Mapping[str, Any]], Sequence[triton.Config]]] = None) -> Entry:
    """Add a kernel to :data:`KERNELS` (under ``name``, default ``fn.__name__``).

    ``configs``: every ``triton.Config`` its launcher may use (the autotune list, or a one-element
    list of the launcher's fixed block sizes, warps and stages; ``triton.Config`` defaults to 4
    warps, 3 stages as the launch does). ``flags``: the value of every other ``tl.constexpr``
    argument on the default path; :data:`VARIANTS` overlay the keys the kernel takes. ``types``:
    arguments whose Triton type is not the one their name gives (``*fp32`` for ``*_ptr``, ``fp32``
    for :data:`FLOAT_ARGS`, else ``i32``), e.g. ``{"idx_ptr": "*i64", "a_ptr": COMPUTE_PTR}``.
    Every integer argument must be listed in :data:`HINTED` or :data:`UNHINTED`. ``pick``: when the
    launcher's configs depend on the flags, the function that gives them (a build then compiles
    those only, as a run would).

    For example, a pure elementwise kernel ``scale_kernel(x_ptr, out_ptr, n, scale, BLOCK:
    tl.constexpr)`` launched with ``BLOCK=1024`` at the default 4 warps::

        register(epilogue.scale_kernel, [triton.Config({"BLOCK": 1024})], {})

    Its builds must then show no ``HGMMA``/``HMMA`` and, on the default path, no spills.
    """
    name = name or fn.__name__
    types = dict(types or {})
    args = fn.arg_names
    constexprs = _constexprs(fn)
    tiles_ = set().union(*(c.kwargs for c in configs))
    problems = [f"types names {k!r}, not an argument" for k in types if k not in args]
    problems += [f"flags name {k!r}, not a constexpr argument" for k in flags if k not in constexprs]
    problems += [f"constexpr {k!r} is in neither flags nor the configs" for k in constexprs - set(flags) - tiles_]
    for a in args:
        if a in constexprs or a.endswith("_ptr") or a in FLOAT_ARGS or types.get(a, "i32") != "i32":
            continue
        if _hint_key(a) not in HINTED and a not in UNHINTED:
            problems.append(f"integer {a!r} is in neither aot.HINTED nor aot.UNHINTED "
                            "(is it a multiple of 16 at run time?)")
    if not configs:
        problems.append("no configs")
    if name in KERNELS:
        problems.append("already registered")
    if problems:
        raise ValueError(f"aot.register({name}): " + "; ".join(problems))
    KERNELS[name] = entry = Entry(fn, list(configs), dict(flags), types, pick)
    return entry


#: The forward's flags on the default path: bf16, one sub-centre, no filter, reading the step's
#: operand (the scored rows normalised and cast to bf16 already: no rows, no scaling).
_FORWARD = dict(K=1, HAS_ROWS=False, NORM_W=False, FILTER=False, SMOOTH=False, COMPUTE=tl.bfloat16,
                DOT=tl.bfloat16, PRECISION="tf32")
_FORWARD_CONFIGS = autotune.FORWARD_CONFIGS + autotune.WIDE_FORWARD_CONFIGS + autotune.HEAVY_FORWARD_CONFIGS
_pick_forward = lambda f: autotune.forward_configs(f["K"], f["FILTER"], f["PRECISION"], f["NORM_W"])  # noqa: E731

register(forward.lse_forward_kernel, _FORWARD_CONFIGS, _FORWARD,
         types={"a_ptr": COMPUTE_PTR, "w_ptr": COMPUTE_PTR, "rows_ptr": "*i64", "tcol_ptr": "*i32"},
         # never with rows, normalisation in registers or the filter: those read the fp32 weight
         pick=lambda f: [] if f["HAS_ROWS"] or f["NORM_W"] or f["FILTER"] else _pick_forward(f))
# The forward that reads the fp32 weight (through Partial FC's rows, normalised in registers): with
# the filter (its cosines need the fp32 rows), or for a shard above chunks.OPERAND_BYTES.
register(forward.lse_forward_kernel, _FORWARD_CONFIGS, {**_FORWARD, "HAS_ROWS": True, "NORM_W": True, "FILTER": True},
         types={"a_ptr": COMPUTE_PTR, "rows_ptr": "*i64", "tcol_ptr": "*i32"}, pick=_pick_forward,
         name="lse_forward_kernel[fp32 W]")
# optimizer.row_sgd_ launches ROW_SGD_TILES (4 warps, 3 stages); the default path is Partial FC's:
# sampled rows (idx), their gradient rows in order, momentum.
register(optimizer.row_sgd_kernel, [triton.Config(dict(zip(("BR", "BD"), optimizer.ROW_SGD_TILES)), num_warps=4, num_stages=3)],
         dict(HAS_IDX=True, G_AT_IDX=False, MOMENTUM=True, NESTEROV=False, GSCALE=False), types={"idx_ptr": "*i64"})

# idle_rows' catch-ups of Partial FC's sampled rows (shardfc.head.catch_up), as launched: SGD at
# BR=32, BD=128 with momentum; AdamW one program a row, BD up to 512 (D = 512 on the default path).
register(idle_rows.catch_up_sgd_kernel, [triton.Config({"BR": 32, "BD": 128}, num_warps=4, num_stages=3)],
         dict(HAS_IDX=True, MOMENTUM=True, EMULATE_RTNE=False),
         types={"idx_ptr": "*i64", "stamps_ptr": "*i32", "table_ptr": "*fp64", "now_ptr": "*i32"})
# Partial FC's counter-based draw (fused/draw.py): one pass of uint32 hashing a block of rows.
register(draw.draw_keys_kernel, [triton.Config({"BLOCK": draw.DRAW_BLOCK})], {},
         types={"present_ptr": "*u8", "keys_ptr": "*i64", "step_ptr": "*i64", "s1": "u32", "s2": "u32"})
register(idle_rows.catch_up_adamw_kernel, [triton.Config({"BD": 512}, num_warps=4, num_stages=3)],
         dict(HAS_IDX=True, EMULATE_RTNE=False),
         types={"idx_ptr": "*i64", "stamps_ptr": "*i32", "table_ptr": "*fp64", "step_ptr": "*fp64"})

# The GEMM path's epilogues (chunks.py launches them at EPILOGUE_TILES / ROW_TILES, the row kernels
# with fewer rows a program where a chunk's rows would not fill the SMs a few times: 4 warps, 3
# stages): elementwise kernels, so their builds must show no tensor-core instruction at all. The
# products and the operand rows are bf16 on the default path; E is written back into the products.


def _row_configs(tile) -> list:
    """A per-row kernel's configs as chunks.row_tile launches them: its widest ``(BR, BD)`` tile and
    the one of chunks.MIN_ROW_TILE rows (a few waves of programs on a chunk's rows)."""
    br, bd = tile
    return [triton.Config({"BR": r, "BD": bd}, num_warps=4, num_stages=3) for r in sorted({br, chunks.MIN_ROW_TILE}, reverse=True)]


_ROWS = _row_configs(chunks.ROW_TILES)
_BLOCK = [triton.Config(dict(zip(("BM", "BN"), t)), num_warps=4, num_stages=3)
          for t in (chunks.EPILOGUE_TILES, chunks.HEAVY_EPILOGUE_TILES)]
# The step's one pass over the scored rows: norms computed, rows normalised and cast (default);
# the per-chunk operand of a shard above OPERAND_BYTES reads the norms instead.
register(epilogue.operand_rows_kernel, _ROWS,
         dict(HAS_ROWS=False, COMPUTE_INV=True, SCALE=True, WRITE=True, EMULATE_RTNE=False),
         types={"rows_ptr": "*i64", "out_ptr": "*bf16"})
_pick_block = lambda f: [_BLOCK[chunks.heavy(f["K"], f["FILTER"])]]  # noqa: E731
register(epilogue.forward_epilogue_kernel, _BLOCK, dict(K=1, FILTER=False, SMOOTH=False),
         types={"p_ptr": "*bf16", "tcol_ptr": "*i32"}, pick=_pick_block)
register(epilogue.backward_epilogue_kernel, _BLOCK, dict(K=1, FILTER=False, SMOOTH=False, EMULATE_RTNE=False),
         types={"p_ptr": "*bf16", "tcol_ptr": "*i32"}, pick=_pick_block)
register(epilogue.weight_grad_kernel, _ROWS,
         dict(HAS_ROWS=False, NORM_W=True, W_HAT=True, ACCUMULATE=True, SCATTER=False, SQ=False, EMULATE_RTNE=False),
         types={"rows_ptr": "*i64", "w_ptr": "*bf16"})
# The update fused into it (head_optimizer(..., fused_update=True)): fp32 centres and momentum,
# the gradient formed from H and the bf16 operand as above, never stored; every row scored, so it
# also writes the next step's bf16 operand rows and norms (NEXT).
register(epilogue.weight_update_kernel, _row_configs(chunks.UPDATE_TILES),
         dict(HAS_ROWS=False, NORM_W=True, W_HAT=True, MOMENTUM=True, NESTEROV=False, NEXT=True, EMULATE_RTNE=False,
              EMULATE_OP=False),
         types={"rows_ptr": "*i64", "w_ptr": "*bf16", "slot_ptr": "*i32", "op_ptr": "*bf16"})
# AdamW's (the same gradient; fp32 centres and moments, the per-row fp64 step count).
register(epilogue.adamw_update_kernel, _row_configs(chunks.ADAMW_UPDATE_TILES),
         dict(HAS_ROWS=False, NORM_W=True, W_HAT=True, NEXT=True, EMULATE_RTNE=False, EMULATE_OP=False),
         types={"rows_ptr": "*i64", "w_ptr": "*bf16", "slot_ptr": "*i32", "step_ptr": "*fp64", "op_ptr": "*bf16"})

#: Option paths beyond each kernel's default: flags overlaid on it (a kernel gets the keys it takes;
#: a variant that changes none of a kernel's flags is not built for it).
VARIANTS: Dict[str, dict] = {
    "default": {},
    "rows+filter+smoothing+subcenters3": dict(HAS_ROWS=True, FILTER=True, SMOOTH=True, K=3),
    "smoothing+subcenters3": dict(SMOOTH=True, K=3),
    "raw-centres": dict(NORM_W=False, W_HAT=False, SCALE=False),
    # A shard above chunks.OPERAND_BYTES: the step's pass computes the norms only, each chunk
    # makes its operand from them, and the weight gradient reads the fp32 rows.
    "large-shard-norms": dict(WRITE=False, W_HAT=False, FILTER=False, NEXT=False),
    "large-shard-chunk-operand": dict(COMPUTE_INV=False),
    "fp32-ieee": dict(COMPUTE=tl.float32, DOT=tl.float32, PRECISION="ieee"),
    "sgd-dense-grad+nesterov": dict(G_AT_IDX=True, NESTEROV=True),
    "sgd-all-rows-no-momentum": dict(HAS_IDX=False, MOMENTUM=False),
    "fused-update-rows+nesterov": dict(HAS_ROWS=True, NESTEROV=True, NEXT=False),
    # --head-grad-clip: the norm summed by the weight-gradient pass, the clip applied by the update.
    "head-grad-clip": dict(SQ=True, GSCALE=True),
}


# --- Building ---------------------------------------------------------------------------------


@dataclass
class Built:
    kernel: str
    config: str
    shared: int
    registers: Optional[int]
    stack_bytes: Optional[int]
    #: Hopper warpgroup MMA (wgmma) instructions in the SASS.
    hgmma: int
    #: Ampere-style mma.sync instructions in the SASS (slow on sm_90).
    hmma: int
    #: LDL + STL instructions in the SASS: local memory, i.e. spilled registers.
    local_ops: int
    #: ... of which inside a loop's body or a subroutine (which a loop may call): those run per
    #: iteration; the others once per program.
    local_ops_in_loops: int
    #: ``tt.dot`` ops in the Triton IR, and those that ask for tensor cores (not fp32 at IEEE).
    dots: int
    tc_dots: int
    #: The arguments built with ``tt.divisibility = 16``.
    hinted: List[str]


def _signature(entry: Entry, flags: Mapping[str, Any]) -> Dict[str, str]:
    fn = entry.fn
    sig, constexprs = {}, _constexprs(fn)
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in entry.types:
            ty = entry.types[name]
            sig[name] = "*" + _DTYPES[flags["COMPUTE"]] if ty == COMPUTE_PTR else ty
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _hinted(sig: Mapping[str, str], dim: int) -> List[str]:
    """The arguments the JIT marks ``tt.divisibility = 16`` in the realistic workload."""
    out = []
    for name, ty in sig.items():
        key = _hint_key(name)
        if ty.startswith("*"):
            out.append(name)
        elif ty == "i32" and key in HINTED and (dim % 16 == 0 or not HINTED[key].startswith("D:")):
            out.append(name)
    return out


_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)
_DOT = re.compile(r"\btt\.dot\b[^\n]*?:\s*tensor<[0-9x]+x(\w+)>")
_PRECISION = re.compile(r"inputPrecision\s*=\s*(\w+)")


def _sass(cubin: bytes) -> dict:
    """Registers and stack bytes per thread, and the opcode counts that matter, from cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "--dump-resource-usage", "--dump-sass", path],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {proc.stderr.strip()}")
    text = proc.stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    ops = _OPCODE.findall(text)
    if not ops:
        raise RuntimeError("cuobjdump printed no SASS")
    return dict(registers=int(regs.group(1)) if regs else None, stack_bytes=int(stack.group(1)) if stack else None,
                hgmma=ops.count("HGMMA"), hmma=ops.count("HMMA"), local_ops=ops.count("LDL") + ops.count("STL"),
                local_ops_in_loops=local_ops_in_loops(text))


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?\w+\s+)?([A-Z][A-Z0-9_]*)[^;\n]*?(?:\s0x([0-9a-f]+))?\s*;")


def local_ops_in_loops(sass: str) -> int:
    """``LDL``/``STL`` of one kernel's SASS that run per loop iteration: inside a loop's body — from
    a backward branch's target to the branch — or in a subroutine, i.e. at or after the first
    ``CALL``'s target (counted as in a loop whether or not a loop calls it). A spill outside those
    runs once per program: a register saved before a loop and restored after it."""
    insns = [(int(a, 16), op, int(t, 16) if t else None) for a, op, t in _INSN.findall(sass)]
    loops = [(target, at) for at, op, target in insns if op == "BRA" and target is not None and target <= at]
    calls = [target for _, op, target in insns if op == "CALL" and target is not None]
    first_sub = min(calls) if calls else None
    return sum(1 for at, op, _ in insns if op in ("LDL", "STL")
               and (any(lo <= at <= hi for lo, hi in loops) or (first_sub is not None and at >= first_sub)))


def _dots(ttir: str) -> tuple:
    """``(dots, tensor-core dots)`` of the Triton IR: fp32 operands at IEEE precision use none."""
    found = [(m.group(1), _PRECISION.search(m.group(0))) for m in _DOT.finditer(ttir)]
    tc = sum(1 for ty, precision in found if not (ty == "f32" and (precision is None or precision.group(1) == "ieee")))
    return len(found), tc


def _label(config: triton.Config) -> str:
    keys = list(config.kwargs)
    return f"{'x'.join(keys)} {'x'.join(str(config.kwargs[k]) for k in keys)} w{config.num_warps} s{config.num_stages}"


def compile_one(name: str, config: triton.Config, flags: Mapping[str, Any], dim: int = DIM,
                capability: int = 90) -> Built:
    """Build kernel ``name`` at ``config`` with constexprs ``flags`` for ``sm_<capability>``."""
    entry = KERNELS[name]
    fn = entry.fn
    sig = _signature(entry, flags)
    hinted = _hinted(sig, dim)
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in {**flags, **config.kwargs}.items()},
                    attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hinted})
    k = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                       options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    dots, tc_dots = _dots(k.asm["ttir"])
    return Built(name, _label(config), k.metadata.shared, dots=dots, tc_dots=tc_dots, hinted=hinted,
                 **_sass(k.asm["cubin"]))


def variant_flags(name: str, variant: str, K: int = 1) -> Optional[dict]:
    """Kernel ``name``'s flags under ``variant``; None when the variant changes none of them."""
    entry = KERNELS[name]
    base = {**entry.flags, **({"K": K} if "K" in entry.flags else {})}
    merged = {**base, **{k: v for k, v in VARIANTS[variant].items() if k in base}}
    return merged if variant == "default" or merged != base else None


def build_all(dim: int = DIM, K: int = 1, capability: int = 90, variants=("default",),
              all_configs: bool = True, kernels: Optional[Sequence[str]] = None) -> Iterator[dict]:
    """Every registered kernel × config × variant that touches it, compiled: one dict each.
    ``all_configs=False``: every config on the default path, the first only on the others."""
    for variant in variants:
        for name in kernels or KERNELS:
            flags = variant_flags(name, variant, K)
            if flags is None:
                continue
            configs = KERNELS[name].configs_for(flags)
            for config in configs if all_configs or variant == "default" else configs[:1]:
                built = compile_one(name, config, flags, dim, capability)
                yield {"variant": variant, **dataclasses.asdict(built)}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardfc.head.fused.aot", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=DIM,
                   help="embedding width: D and the strides are hinted when it is a multiple of 16")
    p.add_argument("--subcenters", type=int, default=1, help="sub-centres per class (K) of the kernels that take one")
    p.add_argument("--capability", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    p.add_argument("--variants", default="default", help=f"comma-separated, of {list(VARIANTS)}, or 'all'")
    p.add_argument("--kernels", default=None, help=f"comma-separated, of {list(KERNELS)} (default: all)")
    p.add_argument("--first-config", action="store_true",
                   help="beyond the default variant, only each kernel's first config")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = p.parse_args(argv)
    variants = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {list(VARIANTS)}")
    kernels = args.kernels.split(",") if args.kernels else None
    for k in kernels or ():
        if k not in KERNELS:
            p.error(f"--kernels: {k!r} is not one of {list(KERNELS)}")
    if not args.json:
        print(f"sm_{args.capability}, D={args.dim}, K={args.subcenters}; hinted: pointers, "
              + ", ".join(sorted(HINTED)) + "; unhinted: " + ", ".join(sorted(UNHINTED)))
        print("| variant | kernel | tiles, warps, stages | shared KB | registers | stack bytes | LDL+STL (in loops) "
              "| tensor-core dots | HGMMA | HMMA |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0
    for b in build_all(args.dim, args.subcenters, args.capability, variants, not args.first_config, kernels):
        if args.json:
            print(json.dumps(b), flush=True)
        else:
            print(f"| {b['variant']} | {b['kernel']} | {b['config']} | {b['shared'] / 1024:.0f} | {b['registers']} "
                  f"| {b['stack_bytes']} | {b['local_ops']} ({b['local_ops_in_loops']}) | {b['tc_dots']}/{b['dots']} "
                  f"| {b['hgmma']} | {b['hmma']} |",
                  flush=True)
        worst = max(worst, b["shared"])
    return 0 if worst <= H100_SHARED_BYTES else 1


if __name__ == "__main__":
    raise SystemExit(main())
