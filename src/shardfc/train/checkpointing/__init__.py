"""What a run saves and what it starts from: checkpoints, class plans, fine-tuning, imports.

    resume.py          save a run to a resharding checkpoint and resume from one, on any number of ranks
    classes.py         which head row each identity gets against the checkpoint a run starts from
    fine_tune.py       --init-from: a trained model on another class set (kept, new and imprinted rows)
    arcface_import.py  an insightface arcface_torch run as a shardfc checkpoint (shardfc import-arcface)
    artifacts.py       a trained backbone read back from a run (shardfc eval / export / embed)

The files themselves (format, resharding, durable writes) are :mod:`shardfc.checkpoint`'s.
"""
