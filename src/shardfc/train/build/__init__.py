"""Building a run from its config: the one factory, the strategies, the pipeline, precision and CPU set-up.

    factory.py         a run from its config: context, data, and (build_model, every strategy's one builder)
                       backbone or pipeline stage, head shard, optimizers, schedules, precision
    strategy.py        ddp / dp / horovod / pipeline: the run's context, backbone and optimizer wrapping, head placement
    pipeline_train.py  --strategy pipeline: the stage cut and schedule, its step, evaluation and checkpoints
    head_update.py     who applies the head's optimizer step: its backward (fused) or step()
    cpu.py             CPU defaults: threads per process, whether bf16 is native

Before this layout the factory was the module ``shardfc.train.build``: its names are read from here for one
release, with a :class:`DeprecationWarning` naming :mod:`shardfc.train.build.factory` (a monkeypatch
must patch ``shardfc.train.build.factory``, the module that uses them).
"""

import warnings


def __getattr__(name):
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from shardfc.train.build import factory  # on first use only: the strategies' modules need none of it
    try:
        value = getattr(factory, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    warnings.warn(f"shardfc.train.build.{name} moved to shardfc.train.build.factory.{name}; the old name goes in "
                  "the next release", DeprecationWarning, stacklevel=2)
    globals()[name] = value  # warned once: the next read finds it here
    return value
