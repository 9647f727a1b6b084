"""shardfc: exact class-sharded softmax / margin losses for classifiers with millions of classes.

Public names::

    shardfc.ShardedMarginHead      the head (process-group, devices or single-shard mode)
    shardfc.margins                ArcFace, CosFace/AMSoftmax, SphereFace, Combined, NormSoftmax, Softmax
    shardfc.baselines              NaiveParallelHead, ReplicatedHead (for comparison)
    shardfc.reference_loss         the plain dense reference the tests compare against
"""

from . import margins
from .head import ShardedMarginHead
from .reference import reference_loss

__version__ = "0.1.0"

__all__ = ["ShardedMarginHead", "margins", "reference_loss", "__version__"]


def __getattr__(name):  # baselines import lazily: they are not needed to train
    if name == "baselines":
        import importlib

        return importlib.import_module(".baselines", __name__)
    raise AttributeError(f"module 'shardfc' has no attribute {name!r}")
