"""The sharded margin head: the math of an exact class-sharded softmax cross-entropy.

    module.py       ShardedMarginHead: layouts, Partial FC sampling, predict, sharded state
    margin_base.py  Margin, the interface every margin implements (and sin θ from cos θ)
    margins.py      margin target logits and their exact derivatives; build_margin, MARGINS
    adaptive_margins.py  AdaFace and MagFace: margins of the feature norm before normalisation
    subcenters.py   after Sub-center ArcFace: keep the dominant centres, flag noisy samples
    kernels.py      one shard's statistics and gradients (pure, no communication), chunked or not
    fused/          the same on a GPU without [B, C] logits (Triton forward, GEMM backward, fused update)
    impl_select.py  impl="auto": time the implementations once per workload, keep the fastest
    function.py     the autograd function combining the shards' statistics
    sampling.py     Partial FC's sampling: which classes a shard scores, which rows a step touched
    partial_fc.py   the row-sparse SGD / AdamW (head_optimizer)
    rounding.py     an fp32 update rounded back into bf16 / fp16 centres (nearest or stochastic)
    validation.py   input checks that raise on every rank
    normalize.py    L2 normalisation with a finite gradient at zero
    layout.py       which class ids each shard holds; the seeded initial rows of any class range
    sharded_state.py  the head's state as one block of classes, for resharding checkpoints
    grow.py         growing a head by new classes, old rows and optimizer state kept
    imprint.py      imprinted centres: the normalised mean embedding of each class, sharded
    reference.py    the plain dense implementation everything is tested against
    baselines.py    NaiveParallelHead, ReplicatedHead (for comparison in bench)
    triplet.py      BatchHardTripletLoss over the global batch (the re-ID recipe's metric loss)
"""

from shardfc.head import margins, partial_fc, subcenters
from shardfc.head.grow import grow_head, grown_state
from shardfc.head.imprint import Imprinted, imprint_centres
from shardfc.head.module import ShardedMarginHead
from shardfc.head.partial_fc import head_optimizer
from shardfc.head.reference import reference_loss
from shardfc.head.triplet import BatchHardTripletLoss

__all__ = ["BatchHardTripletLoss", "Imprinted", "ShardedMarginHead", "grow_head", "grown_state", "head_optimizer",
           "imprint_centres", "margins", "partial_fc", "reference_loss", "subcenters"]
