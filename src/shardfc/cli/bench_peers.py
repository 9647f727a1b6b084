"""``shardfc bench --peers``: the head beside the matmul floor, plain torch (eager and compiled),
torch's ``linear_cross_entropy``, Cut Cross-Entropy and Liger, in one process on one rank's work
(:mod:`shardfc.tools.bench.peers`)::

    shardfc bench --peers --batch 1024 --dim 512 --classes 1000000 --json peers.json --plot peers.png

Prints a Markdown table on stdout (the device, torch and triton versions above it) and progress on
stderr, with the head's own log (logger ``shardfc.head``, INFO: the timing table of ``impl="auto"``'s
choice) on stderr too, each of its lines prefixed ``[shardfc.head]``; ``--quiet`` drops the progress
and keeps only the head's warnings. Exit status: 0 when every row ran or was unavailable (not
installed, not in this torch, needs CUDA), 1 when a row failed (its own error, out of memory) or
its loss disagrees with the reference (the table, ``--json`` and ``--plot`` are written all the
same), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Iterator, List, Optional, TextIO

from shardfc.checks import chunk_size_arg
from shardfc.outputs import check_outputs
from shardfc.tools.bench.peers import DTYPES, MARGINS, SYSTEMS, failures, run_peers

#: the logger the head reports on (``impl="auto"``'s timing table, at INFO)
HEAD_LOGGER = "shardfc.head"


class _PrefixedLines(logging.Formatter):
    """Every line of a record (the head's table is one record of several lines) as ``[logger] line``."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(f"[{record.name}] {line}" for line in super().format(record).splitlines())


@contextlib.contextmanager
def head_log(stream: TextIO, level: int = logging.INFO) -> Iterator[None]:
    """Records of logger :data:`HEAD_LOGGER` at ``level`` and above on ``stream`` while inside; the
    logger's level and handlers as they were afterwards."""
    log = logging.getLogger(HEAD_LOGGER)
    handler = logging.StreamHandler(stream)
    handler.setLevel(level)
    handler.setFormatter(_PrefixedLines("%(message)s"))
    saved = log.level
    if log.getEffectiveLevel() > level:
        log.setLevel(level)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardfc bench --peers",
        description="Time one training step (forward + backward + SGD momentum 0.9 wd 5e-4 on fp32 centres) of the "
        "shardfc head (impl torch / triton / gemm / auto, chunked, Partial FC), plain torch dense (eager, "
        "torch.compile), torch's linear_cross_entropy (plain and batch-chunked), Cut Cross-Entropy and Liger (plain "
        "softmax, when installed) and the bf16 matmul floor, side by side in one process on one rank's work; peak "
        "memory above the resting state; each loss against the dense reference. The head's log (impl=auto's "
        "timing table) goes to stderr, its lines prefixed [shardfc.head].",
    )
    p.add_argument("--peers", action="store_true", help="run this comparison (what selects it)")
    p.add_argument("--batch", type=int, required=True, help="gathered batch B (one rank's work)")
    p.add_argument("--dim", type=int, required=True, help="embedding width D")
    p.add_argument("--classes", type=int, required=True, help="local classes C")
    p.add_argument("--systems", default=None, metavar="NAMES",
                   help=f"comma-separated rows, from {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16",
                   help="compute dtype: autocast for bfloat16/float16, none for float32 (default bfloat16)")
    p.add_argument("--margin", choices=MARGINS, default=None,
                   help="margin of the margin rows, with its defaults (default arcface: s=64 m=0.5)")
    p.add_argument("--sample-rate", type=float, default=None, help="Partial FC rate of shardfc-partial (default 0.1)")
    p.add_argument("--chunk-size", type=chunk_size_arg, default=None,
                   help="classes per chunk of shardfc-chunked, or 'auto' (default auto)")
    p.add_argument("--steps", type=int, default=10, help="timed steps, median reported (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the check step (default 3)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="default: cuda when available (the CPU is for small checks)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: step ms and extra memory per system")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr, and of the head's log only its warnings")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)
    try:
        check_outputs(json=args.json, plot=args.plot)  # before the run, not after it
        with head_log(sys.stderr, logging.WARNING if args.quiet else logging.INFO):
            result = run_peers(
                batch=args.batch, dim=args.dim, classes=args.classes, systems=args.systems, dtype=args.dtype,
                margin=args.margin, sample_rate=args.sample_rate, chunk_size=args.chunk_size, steps=args.steps,
                warmup=args.warmup, device=args.device, progress=not args.quiet,
            )
    except ValueError as e:
        print(f"shardfc bench --peers: error: {e}", file=sys.stderr)
        return 2
    from shardfc.tools.bench import peers_report

    print(peers_report.markdown_table(result), flush=True)
    if args.json:
        peers_report.write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        try:
            peers_report.plot(result, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr)
        except ImportError as e:  # matplotlib is optional: the table and JSON stand without it
            print(f"shardfc bench --peers: no plot: {e} (pip install matplotlib)", file=sys.stderr)
            return 1
    bad = failures(result)
    for line in bad:
        print(f"shardfc bench --peers: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
