"""shardfc: exact class-sharded softmax / margin losses for classifiers with millions of classes.

Public names::

    shardfc.ShardedMarginHead      the head (process-group, devices or single-shard mode)
    shardfc.margins                ArcFace, CosFace/AMSoftmax, SphereFace, Combined, AdaFace, MagFace, NormSoftmax, Softmax
    shardfc.head_optimizer         the head's optimizer (row-sparse under Partial FC)
    shardfc.reference_loss         the plain dense reference the tests compare against
    shardfc.baselines              NaiveParallelHead, ReplicatedHead (for comparison)

Where things live (docs/architecture.md has the picture): ``shardfc.head`` the math,
``shardfc.parallel`` the data movement and launch, ``shardfc.checkpoint`` resharding checkpoints,
``shardfc.train`` the training loop, ``shardfc.tools`` bench / plan / demo.
"""

import sys as _sys

from shardfc import _moved
from shardfc.head import ShardedMarginHead, head_optimizer, margins, partial_fc, reference_loss
from shardfc.version import __version__

__all__ = ["ShardedMarginHead", "head_optimizer", "margins", "reference_loss", "__version__"]

# Names of the flat layout before 0.2, kept as aliases of the modules that now hold them:
# ``shardfc.margins`` stays public; ``shardfc.partial_fc`` is deprecated (use
# ``shardfc.head_optimizer`` / ``shardfc.head.partial_fc``).
_sys.modules[__name__ + ".margins"] = margins
_sys.modules[__name__ + ".partial_fc"] = partial_fc
# Modules that moved (train/ by concept, every command in shardfc.cli): their old names for one release.
_moved.install()


def __getattr__(name):  # baselines import lazily: they are not needed to train
    if name == "baselines":
        import importlib

        module = importlib.import_module("shardfc.head.baselines")
        _sys.modules[__name__ + ".baselines"] = module
        return module
    raise AttributeError(f"module 'shardfc' has no attribute {name!r}")
