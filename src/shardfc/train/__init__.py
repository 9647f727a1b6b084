"""``shardfc train`` and its companions: configuration, the training loop, and the eval/export/embed tools.

    from shardfc.train import TrainConfig, train
    summary = train(TrainConfig(max_steps=100, nproc=1))   # in this process, no process group

``shardfc.train.cli.run(cfg)`` picks the launch (spawned processes, torchrun, or in-process) the way
the command line does.
"""

from shardfc.train.config import ConfigError, TrainConfig, parse_config
from shardfc.train.trainer import train

__all__ = ["ConfigError", "TrainConfig", "parse_config", "train"]
