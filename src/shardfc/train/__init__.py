"""``shardfc train`` and its companions.

    config.py     TrainConfig (a docstring per field), TOML presets, flags
    strategy.py   ddp / dp / horovod / pipeline: the run's context, backbone and optimizer wrapping, head placement
    build.py      a run from its config: context, data, and (build_model, every strategy's one builder) backbone
                  or pipeline stage, head shard, optimizers, schedules, precision
    head_update.py      who applies the head's optimizer step: its backward (fused) or step()
    pipeline_train.py   --strategy pipeline: the stage cut and schedule, its step, evaluation and checkpoints
    loop.py       train(): build -> resume -> loop -> save, read top to bottom
    step.py       one optimizer step (micro-batches, fp16 overflow agreement, clipping)
    state.py      what a run is made of (Parts) and where it stands (RunState)
    data.py       the dataset, per-rank resumable batches, the micro-batch stream
    identity_sampler.py  P x K identity batches (the re-ID recipe)
    prefetch.py   batches copied to the device ahead of the step; dali_loader.py: --loader dali
    schedule.py   warm-up + poly / cosine decay
    cpu.py        CPU defaults: threads per process, whether bf16 is native
    resume.py     save to and restore from resharding checkpoints
    classes.py    which head row each identity gets against the checkpoint a run starts from
    fine_tune.py  --init-from: a trained model on another class set (kept, new and imprinted rows)
    stopping.py   the stop-signal agreement of all ranks
    reporting.py  setup lines, loss / lr / throughput windows, evaluations
    runlog.py     train.log, metrics.csv, curves.png, the progress bar
    profile.py, phases.py, memory_phases.py   --profile: step times by phase, traffic, peak memory, start-up
    evaluate.py   evaluation targets (.bin verification, re-ID, synthetic pairs)
    cli*.py, artifacts.py   shardfc train / eval / export / embed / import-arcface (arcface_import.py)

    from shardfc.train import TrainConfig, train
    summary = train(TrainConfig(max_steps=100, nproc=1))   # in this process, no process group

``shardfc.cli.train.run(cfg)`` picks the launch (spawned processes, torchrun, horovodrun, or
in-process) the way the command line does.
"""

from shardfc.train.config import ConfigError, TrainConfig, parse_config
from shardfc.train.loop import train

__all__ = ["ConfigError", "TrainConfig", "parse_config", "train"]
