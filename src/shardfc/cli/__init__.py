"""``shardfc`` command line: one sub-command per job, each in its own module of this package.

This module is the dispatcher (``shardfc = "shardfc.cli:main"``, ``python -m shardfc``); the commands
parse their arguments and call the library, whose implementation stays in its own package:

    train.py           shardfc train: the config resolved, then spawned / torchrun / horovodrun / in-process (run)
    eval.py            shardfc eval: a checkpoint on verification pairs, IJB-B/C or a re-ID split
    export.py          shardfc export: a checkpoint's backbone as TorchScript / ONNX
    embed.py           shardfc embed: embeddings of a folder of images
    import_arcface.py  shardfc import-arcface: an arcface_torch run as a checkpoint (shardfc.train.checkpointing)
    data.py            shardfc data: pack / inspect / shuffle / verify RecordIO (shardfc.data.recordio_ops), glyphs
    bench.py           shardfc bench: the head variants (shardfc.tools.bench); dispatches --peers, --recipes, --trainer
    bench_recipes.py   shardfc bench --recipes / --split-sweep
    bench_peers.py     shardfc bench --peers
    plan.py            shardfc plan (shardfc.tools.plan)
    demo.py            shardfc demo: a sharded head on 2 spawned CPU processes
    torchrun.py        shardfc torchrun: the training flags checked, then torchrun (shardfc.parallel.torchrun)

The modules' names before this layout (``shardfc.train.cli``, ``shardfc.data.cli``, ...) import these
for one release (:mod:`shardfc._moved`).
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

# name -> (module with a ``main(argv) -> int``, one-line help)
COMMANDS = {
    "train": ("shardfc.cli.train", "train an embedding model with a sharded margin head (default: synthetic demo)"),
    "torchrun": ("shardfc.cli.torchrun", "run `shardfc train` under torchrun, set up for elastic restarts"),
    "eval": ("shardfc.cli.eval", "evaluate a checkpoint: face verification (.bin) or re-ID (query/gallery)"),
    "export": ("shardfc.cli.export", "write the backbone for inference (TorchScript / ONNX)"),
    "embed": ("shardfc.cli.embed", "write embeddings for a folder of images"),
    "import-arcface": ("shardfc.cli.import_arcface", "turn an insightface arcface_torch run or backbone into a shardfc checkpoint"),
    "data": ("shardfc.cli.data", "pack, inspect, shuffle and verify insightface/MXNet RecordIO datasets (.rec/.idx)"),
    "bench": ("shardfc.cli.bench", "measure step time, memory and traffic of the head variants, or of whole training recipes (--recipes)"),
    "plan": ("shardfc.cli.plan", "predict per-rank memory and the largest C and B that fit"),
    "demo": ("shardfc.cli.demo", "train a sharded head on 2 spawned CPU processes and print the loss"),
}


def usage() -> str:
    """The dispatcher's help: every command with its one-line help (also the top of docs/cli.md)."""
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
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"shardfc: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
