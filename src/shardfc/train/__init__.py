"""``shardfc train`` and its companions.

    config.py     TrainConfig (a docstring per field), TOML presets, flags
    strategy.py   ddp / dp / horovod: the run's context, backbone and optimizer wrapping, head placement
    build.py      a run from its config: context, data, and (build_model, every strategy's one builder) backbone
                  or pipeline stage, head shard, optimizers, schedules, precision
    pipeline_train.py   --strategy pipeline: the stage cut and schedule, its step, evaluation and checkpoints
    loop.py       train(): build -> resume -> loop -> save, read top to bottom
    step.py       one optimizer step (micro-batches, fp16 overflow agreement, clipping)
    data.py       the dataset, per-rank resumable batches, the micro-batch stream
    schedule.py   warm-up + poly / cosine decay
    resume.py     save to and restore from resharding checkpoints
    reporting.py  setup lines, loss / lr / throughput windows, evaluations
    runlog.py     train.log, metrics.csv, curves.png, the progress bar
    evaluate.py   evaluation targets (.bin verification, re-ID, synthetic pairs)
    cli*.py, artifacts.py   shardfc train / eval / export / embed

    from shardfc.train import TrainConfig, train
    summary = train(TrainConfig(max_steps=100, nproc=1))   # in this process, no process group

``shardfc.train.cli.run(cfg)`` picks the launch (spawned processes, torchrun, horovodrun, or
in-process) the way the command line does.
"""

from shardfc.train.config import ConfigError, TrainConfig, parse_config
from shardfc.train.loop import train

__all__ = ["ConfigError", "TrainConfig", "parse_config", "train"]
