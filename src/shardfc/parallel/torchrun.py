"""``shardfc torchrun``: torchrun running ``shardfc train``, set up so that elastic restarts work.

torchrun's rendezvous shares its TCP store with the workers' process group by default; after a
restart the new group then cannot connect (gloo's full-mesh connect is refused or hangs: torch
issue #135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each round its own store, but it
must be set in torchrun's own process, before it starts: this wrapper sets it and runs

    python -m torch.distributed.run TORCHRUN_OPTIONS -m shardfc train -- TRAIN_FLAGS

in its place. The ``--`` keeps torchrun's parser off the training flags (it would take '--m' for
an abbreviation of '--max-restarts').
"""

from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional, Tuple

#: The variable that gives every rendezvous round its own store (read by torchrun, not the workers).
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

USAGE = """usage: shardfc torchrun [TORCHRUN OPTIONS] [-- SHARDFC TRAIN FLAGS]

Run `shardfc train` under torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so that
--max-restarts restarts resume reliably. Example:

  shardfc torchrun --standalone --nproc-per-node 2 --max-restarts 3 -- --preset ms1mv3_r50_arcface --m 0.4

TORCHRUN OPTIONS are torchrun's own (torchrun --help); the flags after `--` are shardfc train's."""


def split_argv(argv: List[str]) -> Tuple[List[str], List[str]]:
    """``(torchrun's options, shardfc train's flags)`` of ``shardfc torchrun ARGV``: split at the first ``--``."""
    if "--" in argv:
        split = argv.index("--")
        return argv[:split], argv[split + 1 :]
    return argv, []


def torchrun_command(argv: List[str]) -> List[str]:
    """The torchrun command line for ``shardfc torchrun ARGV``."""
    launcher, train_flags = split_argv(argv)
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "shardfc", "train", "--", *train_flags]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    env = {**os.environ, SHARE_STORE_ENV: os.environ.get(SHARE_STORE_ENV, "1")}
    command = torchrun_command(argv)
    os.execve(command[0], command, env)  # torchrun in this process's place: signals reach it directly
    return 1  # not reached


def warn_if_restarts_unsafe(rank: int) -> None:
    """On rank 0 of a torchrun run with restarts enabled, warn when torchrun shares its store."""
    if rank != 0 or os.environ.get(SHARE_STORE_ENV) == "1":
        return
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return
    if restarts > 0:
        logging.getLogger("shardfc.launch").warning(
            "torchrun --max-restarts %d without %s=1 in torchrun's environment: after a restart the process "
            "group may fail to form (torch issue #135712). Start it with `%s=1 torchrun ...` or `shardfc torchrun`.",
            restarts, SHARE_STORE_ENV, SHARE_STORE_ENV,
        )


__all__ = ["SHARE_STORE_ENV", "USAGE", "main", "split_argv", "torchrun_command", "warn_if_restarts_unsafe"]
