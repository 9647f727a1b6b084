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

from shardfc.parallel import torchrun
from shardfc.train.config import ConfigError, parse_config

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _, train_flags = torchrun.split_argv(argv)
    if argv[:1] not in (["-h"], ["--help"]) and not {"-h", "--help"} & set(train_flags):
        try:
            parse_config(train_flags)
        except ConfigError as e:
            print(f"shardfc torchrun: error: {e}", file=sys.stderr)
            return 2
    return torchrun.main(argv)
