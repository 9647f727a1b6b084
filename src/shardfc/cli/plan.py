"""``shardfc plan``: the command line of :func:`shardfc.tools.plan.plan` (per-rank memory of the
sharded head's step, and the largest C and B that fit a budget)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from shardfc.checks import chunk_size_arg
from shardfc.outputs import check_outputs, write_atomically
from shardfc.tools.plan import DTYPES, MEMORY_MODELS, OPTIMIZERS, PLAN_IMPLS, format_plan, plan
from shardfc.tools.plan.traffic import format_chunk_candidates, format_traffic

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="shardfc plan", description="Per-rank memory of the sharded head, and the largest C and B that fit a budget.")
    p.add_argument("--classes", type=int, required=True, help="number of classes C")
    p.add_argument("--dim", type=int, required=True, help="embedding width D")
    p.add_argument("--batch", type=int, required=True, help="GLOBAL batch B")
    p.add_argument("--world-size", type=int, default=1, help="ranks W (default 1)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--sample-rate", type=float, default=1.0, help="Partial FC rate in (0, 1] (default 1)")
    p.add_argument("--chunk-size", type=chunk_size_arg, default=None, help="classes per chunk, or 'auto' (default: none)")
    p.add_argument("--budget", default=None, help="bytes per rank, e.g. 16GiB, 500MB, 1e9")
    p.add_argument("--margin", default="arcface", help="margin name (default arcface)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--memory-model", choices=MEMORY_MODELS, default="allocated",
                   help="allocated: every tensor counts from its creation (the only model)")
    p.add_argument("--grads-kept", dest="grad_in_place", action=argparse.BooleanOptionalAction, default=True,
                   help="--grads-kept (default): the head's gradient stays allocated between steps "
                        "(zero_grad(set_to_none=False)) and the step adds into it in place; --no-grads-kept: "
                        "zero_grad(set_to_none=True), the step allocates the [n, D] gradient")
    p.add_argument("--sparse-grad", action="store_true",
                   help="Partial FC's row-sparse weight gradient (the sampled rows only; needs --sample-rate < 1)")
    p.add_argument("--subcenters", type=int, default=1,
                   help="Sub-center ArcFace: K centres (weight rows) per class (default 1)")
    p.add_argument("--head-impl", dest="impl", choices=PLAN_IMPLS, default="torch",
                   help="the head's implementation to replay: torch (default; the CPU's), triton or gemm (the GPU "
                        "paths impl=auto chooses between on a CUDA GPU; need Triton installed)")
    p.add_argument("--sms", type=int, default=None,
                   help="with --head-impl triton/gemm: the GPU's SM count (default 132, an H100 SXM), which sizes "
                        "the forward's partial statistics")
    p.add_argument("--fused-update", action="store_true",
                   help="with --head-impl triton/gemm: the optimizer's step (SGD or AdamW) applied in the backward "
                        "(head_optimizer(..., fused_update=True)): no .grad")
    p.add_argument("--compute-dtype", choices=tuple(DTYPES), default=None,
                   help="the matmuls' dtype as autocast sets it (bfloat16 with --dtype float32: the trainer's --amp); "
                        "default: --dtype")
    p.add_argument("--bytes", dest="traffic", action="store_true",
                   help="also print the HBM bytes each kernel of the step reads and writes (an L2 model of --l2), "
                        "their sum and each GEMM's shape")
    p.add_argument("--l2", dest="l2_bytes", default=None,
                   help="the GPU's L2 (default 50MiB, an H100's): sizes the GPU paths' chunks and the --bytes model")
    p.add_argument("--gpu-chunk-scale", type=int, default=None,
                   help="with --head-impl triton/gemm: the chunks as a multiple of the L2-sized one, 1, 2, 4 or 8 "
                        "(default: the head's default); --bytes also prints every scale's launches, bytes and host issue time")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        check_outputs(json=args.json)
        # A GPU setting the torch path does not read would be dropped silently: refused instead.
        if args.sms is not None and args.impl == "torch":
            raise ValueError(f"--sms {args.sms} sizes the GPU paths' statistics: it needs --head-impl triton or gemm")
        if args.chunk_size is not None and args.impl != "torch":  # and the other way round
            raise ValueError(f"--chunk-size {args.chunk_size} walks the torch path's logits in chunks: --head-impl "
                             f"{args.impl} holds none (its chunks are --gpu-chunk-scale's)")
        if args.l2_bytes is not None and args.impl == "torch" and not args.traffic:
            raise ValueError(f"--l2 {args.l2_bytes} sizes the GPU paths' chunks and the --bytes model: it needs "
                             "--head-impl triton or gemm, or --bytes")
        result = plan(
            args.classes, args.dim, args.batch, args.world_size, args.dtype, args.optimizer, args.sample_rate,
            args.chunk_size, args.budget, margin=args.margin, weight_decay=args.weight_decay,
            memory_model=args.memory_model, grad_in_place=args.grad_in_place, sparse_grad=args.sparse_grad,
            subcenters=args.subcenters, impl=args.impl, sms=132 if args.sms is None else args.sms,
            fused_update=args.fused_update, compute_dtype=args.compute_dtype, traffic=args.traffic,
            l2_bytes="50MiB" if args.l2_bytes is None else args.l2_bytes,
            gpu_chunk_scale=args.gpu_chunk_scale,
        )
    except ValueError as e:
        print(f"shardfc plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(result))
    if "traffic" in result:
        print()
        print(format_traffic(result["traffic"]))
    if "chunk_candidates" in result:
        print()
        print(format_chunk_candidates(result["chunk_candidates"]))
    if args.json:
        try:
            write_atomically(Path(args.json), lambda scratch: scratch.write_text(json.dumps(result, indent=2) + "\n"))
        except OSError as e:
            print(f"shardfc plan: error: {e}", file=sys.stderr)
            return 2
    return 0
