"""Experiment, not a feature: train Partial FC's head with torch's dense SGD, as insightface's
PartialFC_V2 does (its optimizer holds the whole weight: every row gets its momentum and weight
decay every step, sampled or not), instead of shardfc's row-sparse update (a row moves only in the
steps that sample it). docs/accuracy.md's "dense momentum" row:

    cp scripts/experiments/dense_pfc_sitecustomize.py /tmp/dense_pfc/sitecustomize.py
    DENSE_PFC=1 PYTHONPATH=/tmp/dense_pfc shardfc train --preset glyphs --data-root data/glyphs4k \\
        --seed S --epochs 3 --batch-size 32 --sample-rate 0.1

``sitecustomize`` is imported by every Python process that starts with it on the path, so the
spawned ranks get the change too. It costs what the row-sparse update saves: a pass over every row's
weight, gradient and momentum each step.
"""

import os

if os.environ.get("DENSE_PFC") == "1":
    import torch

    import shardfc.train.builder.factory as factory

    _row_sparse = factory.head_optimizer

    def head_optimizer(head, name, lr, **kw):  # momentum and nesterov come for SGD only (AdamW refuses them)
        if getattr(head, "sample_rate", 1.0) < 1.0 and name == "sgd" and not head.sparse_grad:
            head.take_sampled_rows = lambda: {}  # nothing asks for the sampled rows any more
            return torch.optim.SGD(list(head.parameters()), lr=lr, momentum=kw.get("momentum", 0.9),
                                   weight_decay=kw.get("weight_decay", 5e-4), nesterov=kw.get("nesterov", False))
        return _row_sparse(head, name, lr, **kw)

    factory.head_optimizer = head_optimizer
