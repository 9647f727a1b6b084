"""``shardfc torchrun``: the training flags checked once, here, then torchrun in this process's place
(:mod:`shardfc.parallel.torchrun`).

Every worker torchrun starts resolves the same flags; a typo or a refused value would otherwise stop
each of them in turn and end in torchrun's page-long failure report per worker (after the
rendezvous, and after ``--max-restarts`` retries of a run that cannot start). The node that runs
this command is one of the run's nodes, so its files are the ones its workers read.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from shardfc.checks import digits_value
from shardfc.cli.train import check_output_dir
from shardfc.parallel import torchrun
from shardfc.train.config import ConfigError, parse_config

__all__ = ["main"]


#: torchrun's spellings of its per-node process count.
NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node")


def nproc_per_node(launcher: List[str]) -> Optional[str]:
    """The value torchrun's options give ``--nproc-per-node`` (the last one given), or None."""
    value = None
    for i, arg in enumerate(launcher):
        name, eq, given = arg.partition("=")
        if name in NPROC_FLAGS:
            value = given if eq else (launcher[i + 1] if i + 1 < len(launcher) else None)
    return value


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher, train_flags = torchrun.split_argv(argv)
    if not {"-h", "--help"} & set(train_flags):  # the workers print train's help (parse_config would exit)
        count = nproc_per_node(launcher)
        if count is not None and digits_value(count.lstrip("-")) is not None and int(count) < 1:  # torchrun: an AssertionError
            print(f"shardfc torchrun: error: --nproc-per-node must be >= 1 (or auto, cpu, gpu), got {count}",
                  file=sys.stderr)
            return 2
        try:
            check_output_dir(parse_config(train_flags)[0])
        except ConfigError as e:
            print(f"shardfc torchrun: error: {e}", file=sys.stderr)
            return 2
    return torchrun.main(argv)
