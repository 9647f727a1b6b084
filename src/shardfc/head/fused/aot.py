"""Compile the fused kernels for a GPU without one: shared memory, registers and spills per config.

Triton compiles ahead of time for any target (``GPUTarget("cuda", 90, 32)``: an H100) with the
``ptxas`` its wheel bundles (and reads the result with its ``cuobjdump``), so a CPU machine can check that every autotune config of every kernel
builds, fits the SM's shared memory and keeps its accumulators in registers — what the interpreter
cannot tell. ``python -m shardfc.head.fused.aot`` prints a table; the tests compile the main configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shardfc.head.fused import autotune, backward, forward

#: Shared memory an H100 SM grants one block (227 KB).
H100_SHARED_BYTES = 232448
_POINTERS = {
    "rows_ptr": "*i64", "tcol_ptr": "*i32", "tsub_ptr": "*i32",
}
_FLOATS = {"scale", "threshold", "eps_over_c", "one_minus_eps"}


@dataclass
class Built:
    kernel: str
    config: str
    shared: int
    registers: Optional[int]
    stack_bytes: Optional[int]


def _signature(fn, weight: str, act: str) -> Dict[str, str]:
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            default = "*" + weight if name in ("w_ptr", "gw_ptr") else "*" + act if name == "a_ptr" else "*fp32"
            sig[name] = _POINTERS.get(name, default)
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _resource_usage(cubin: bytes) -> tuple:
    """``(registers, stack bytes)`` per thread of the compiled kernel, from the bundled cuobjdump
    (a stack above a few bytes is spilled registers)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return (int(regs.group(1)) if regs else None, int(stack.group(1)) if stack else None)


def compile_one(fn, config: triton.Config, flags: dict, weight: str = "fp32", capability: int = 90) -> Built:
    constexprs = {**flags, **config.kwargs}
    names = fn.arg_names
    act = {tl.bfloat16: "bf16", tl.float16: "fp16", tl.float32: "fp32"}[flags["COMPUTE"]]
    src = ASTSource(fn=fn, signature=_signature(fn, weight, act),
                    constexprs={(names.index(k),): v for k, v in constexprs.items() if k in names})
    k = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                       options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    regs, spill = _resource_usage(k.asm["cubin"])
    tiles = "x".join(str(config.kwargs[x]) for x in ("BM", "BN", "BD"))
    return Built(fn.__name__, f"{tiles} w{config.num_warps} s{config.num_stages}", k.metadata.shared, regs, spill)


def default_flags(dim: int = 512, K: int = 1, compute=tl.bfloat16) -> Dict[str, dict]:
    base = dict(K=K, HAS_ROWS=False, NORM_W=True, FILTER=False, SMOOTH=False, COMPUTE=compute, DOT=compute,
                PRECISION="tf32")
    dp = max(16, triton.next_power_of_2(dim))
    return {
        "lse_forward_kernel": base,
        "grad_a_kernel": {**base, "DP": dp},
        "grad_w_kernel": {**base, "DP": dp, "ACCUMULATE": True, "SCATTER": False},
    }


#: Option paths beyond the default (bf16, centres normalised, D = 512): each kernel must build them.
VARIANTS = {
    "default": {},
    "rows+filter+smoothing+subcenters3+scatter": dict(HAS_ROWS=True, FILTER=True, SMOOTH=True, K=3, SCATTER=True),
    "raw-centres+new-grad": dict(NORM_W=False, ACCUMULATE=False),
    "fp32-ieee": dict(COMPUTE=tl.float32, DOT=tl.float32, PRECISION="ieee"),
}


def build_all(dim: int = 512, K: int = 1, capability: int = 90, variants=("default",), all_configs: bool = True) -> Iterator[dict]:
    """Every kernel × config (or its first only) × variant, compiled: one dict each."""
    flags = default_flags(dim, K)
    for variant in variants:
        for fn, configs in ((forward.lse_forward_kernel, autotune.FORWARD_CONFIGS),
                            (backward.grad_a_kernel, autotune.GRAD_A_CONFIGS),
                            (backward.grad_w_kernel, autotune.GRAD_W_CONFIGS)):
            merged = {k: v for k, v in {**flags[fn.__name__], **VARIANTS[variant]}.items() if k in fn.arg_names}
            for config in configs if all_configs else configs[:1]:
                yield {"variant": variant, **dataclasses.asdict(compile_one(fn, config, merged, capability=capability))}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardfc.head.fused.aot", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--subcenters", type=int, default=1)
    p.add_argument("--capability", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    p.add_argument("--variants", default="default", help=f"comma-separated, of {sorted(VARIANTS)}, or 'all'")
    p.add_argument("--first-config", action="store_true", help="only each kernel's first autotune config")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = p.parse_args(argv)
    variants = sorted(VARIANTS) if args.variants == "all" else args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {sorted(VARIANTS)}")
    if not args.json:
        print(f"sm_{args.capability}, D={args.dim}, K={args.subcenters}")
        print("| variant | kernel | tiles BMxBNxBD, warps, stages | shared KB | registers | stack bytes (spills) |")
        print("|---|---|---|---:|---:|---:|")
    worst = 0
    for b in build_all(args.dim, args.subcenters, args.capability, variants, not args.first_config):
        if args.json:
            print(json.dumps(b), flush=True)
        else:
            print(f"| {b['variant']} | {b['kernel']} | {b['config']} | {b['shared'] / 1024:.0f} | {b['registers']} | {b['stack_bytes']} |")
        worst = max(worst, b["shared"])
    return 0 if worst <= H100_SHARED_BYTES else 1


if __name__ == "__main__":
    raise SystemExit(main())
