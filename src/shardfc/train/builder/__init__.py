"""Building a run from its config: the one factory, the strategies, the pipeline, precision and CPU set-up.

    factory.py         a run from its config: context, data, and (build_model, every strategy's one builder)
                       backbone or pipeline stage, head shard, optimizers, schedules, precision
    strategy.py        ddp / dp / horovod / pipeline: the run's context, backbone and optimizer wrapping, head placement
    pipeline_train.py  --strategy pipeline: the stage cut and schedule, its step, evaluation and checkpoints
    head_update.py     who applies the head's optimizer step: its backward (fused) or step()
    cpu.py             CPU defaults: threads per process, whether bf16 is native

Before this layout the factory was the module ``shardfc.train.build``, which now imports ``factory``
for one release (:mod:`shardfc._moved`). The package is not called ``build``: pytest does not collect
folders of that name, and ``.gitignore`` ignores them.
"""
