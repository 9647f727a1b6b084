"""``shardfc train``: the training loop at the top, each concept it uses in a package of its own.

    loop.py        train(): build -> resume -> loop -> save, read top to bottom
    step.py        one optimizer step (micro-batches, fp16 overflow agreement, clipping)
    state.py       what a run is made of (Parts) and where it stands (RunState)
    schedule.py    warm-up + poly / cosine decay
    stopping.py    the stop-signal agreement of all ranks
    config/        TrainConfig: its fields and rules, their sections, TOML + presets, the flag parser
    builder/       a run from its config: the one factory, the strategies (ddp / dp / horovod / pipeline),
                   the pipeline's stage and schedule, who applies the head's step, the CPU set-up
    loader/        the training data: the stream, P x K identity batches, --loader dali, prefetch to the device
    checkpointing/ save and resume, class plans, --init-from (fine-tuning), arcface_torch import, run artifacts
    observe/       reporting, train.log / metrics.csv, evaluation during training, --profile and its phases

The commands (``shardfc train``, ``eval``, ``export``, ``embed``, ``import-arcface``) are in
:mod:`shardfc.cli`. The module names before this layout (``shardfc.train.data``, ``shardfc.train.cli``, ...)
import their new homes for one release, with a DeprecationWarning (:mod:`shardfc._moved`).

    from shardfc.train import TrainConfig, train
    summary = train(TrainConfig(max_steps=100, nproc=1))   # in this process, no process group

``shardfc.cli.train.run(cfg)`` picks the launch (spawned processes, torchrun, horovodrun, or
in-process) the way the command line does.
"""

from shardfc.train.config import ConfigError, TrainConfig, parse_config
from shardfc.train.loop import train

__all__ = ["ConfigError", "TrainConfig", "parse_config", "train"]
