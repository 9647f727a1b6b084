"""``shardfc`` command line: one sub-command per job, each implemented in its own module."""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

# name -> (module with a ``main(argv) -> int``, one-line help)
COMMANDS = {
    "train": ("shardfc.train.cli", "train an embedding model with a sharded margin head (default: synthetic demo)"),
    "torchrun": ("shardfc.parallel.torchrun", "run `shardfc train` under torchrun, set up for elastic restarts"),
    "eval": ("shardfc.train.cli_eval", "evaluate a checkpoint: face verification (.bin) or re-ID (query/gallery)"),
    "export": ("shardfc.train.cli_export", "write the backbone for inference (TorchScript / ONNX)"),
    "embed": ("shardfc.train.cli_embed", "write embeddings for a folder of images"),
    "import-arcface": ("shardfc.train.cli_import", "turn an insightface arcface_torch run or backbone into a shardfc checkpoint"),
    "data": ("shardfc.data.cli", "pack, inspect, shuffle and verify insightface/MXNet RecordIO datasets (.rec/.idx)"),
    "bench": ("shardfc.tools.bench.cli", "measure step time, memory and traffic of the head variants, or of whole training recipes (--recipes)"),
    "plan": ("shardfc.tools.plan", "predict per-rank memory and the largest C and B that fit"),
    "demo": ("shardfc.tools.demo", "train a sharded head on 2 spawned CPU processes and print the loss"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: shardfc <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "shardfc <command> --help shows a command's options."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `torchrun ... -m shardfc -- train ...` on a Python whose argparse keeps the separator
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"shardfc: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
