"""``TrainConfig``: every knob of ``shardfc train``, its default, its help text and the rules its values obey.

Each field's help text is its attribute docstring below, so the dataclass is the single source of truth for
``--help`` (:mod:`.sections` reads them); :meth:`TrainConfig.validate` checks ranges and combinations.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from shardfc.checks import FLOAT32_MAX, MAX_SEED, MAX_TIMEOUT_S

__all__ = [
    "ConfigError",
    "STRATEGIES",
    "TrainConfig",
    "FIELDS",
    "absolute_paths",
    "check_flags_read",
]


class ConfigError(ValueError):
    """A configuration value, key, file or flag is invalid; the message names it."""


#: The widest embedding and the largest input side a config may ask for (the head is [classes, dim],
#: the first activations [batch, C, H, W]: a saved config naming 2^25 would allocate gigabytes).
MAX_EMBEDDING_DIM = 1 << 16
MAX_IMAGE_SIDE = 4096
#: Largest ``pg_timeout``: :data:`shardfc.checks.MAX_TIMEOUT_S` (31 years; timedelta's range ends later).
MAX_PG_TIMEOUT = MAX_TIMEOUT_S
#: Most intra-op threads per process (16,384 killed the process here; a machine has far fewer cores).
MAX_THREADS = 1024

#: Values of ``TrainConfig.strategy`` (what each does: :mod:`shardfc.train.builder.strategy`).
STRATEGIES = ("ddp", "dp", "horovod", "pipeline")

#: Values of ``TrainConfig.pipeline_schedule`` (torch.distributed.pipelining's schedules).
PIPELINE_SCHEDULES = ("gpipe", "1f1b")

#: Other names of a margin, accepted as the Python API accepts them (shardfc.margins.build_margin).
MARGIN_ALIASES = {"amsoftmax": "cosface"}



@dataclass
class TrainConfig:
    """Configuration of one training run (see the module docstring for how it is assembled)."""

    # ------------------------------------------------------------------ data
    dataset: str = "synthetic"
    """Training data: 'synthetic' (generated identities, no files), 'folder' (one sub-folder per identity under data_root), 'recordio' (insightface / MXNet train.rec + train.idx in data_root, no mxnet needed), 'list' (insightface-style 'path label' lines in list_file) or 'market1501' (data_root/bounding_box_train/ of a Market-1501 style re-ID set, person ids from the file names; junk and distractors left out)."""
    data_root: str = ""
    """Root folder of the 'folder' dataset; folder with train.rec/train.idx (or the .rec path) of 'recordio', where relative val_bins are also looked up; base folder of relative paths of the 'list' dataset (default: the list file's folder); the Market-1501 root (holding bounding_box_train/) of 'market1501'."""
    list_file: str = ""
    """The 'path label' list file of the 'list' dataset."""
    image_size: List[int] = field(default_factory=list)
    """Input size 'H W' of the backbone, each side at most 4096; empty: the backbone's default (112x112 faces, 256x128 re-ID, 32x32 tiny)."""
    synthetic_identities: int = 1000
    """Number of identities (classes) of the synthetic dataset."""
    synthetic_images_per_identity: int = 20
    """Training images per identity of the synthetic dataset."""
    num_workers: int = 0
    """DataLoader worker processes per rank, started once and kept for the whole run (they load the next epoch's first batches while this epoch's last ones train); 0: load in the training process (synthetic images render faster than workers could ship them on a small CPU)."""
    max_corrupt_images: int = 1000
    """Distinct corrupt images a run skips before it stops: an image that does not decode, declares more pixels than SHARDFC_MAX_IMAGE_PIXELS allows, or is not a regular file inside data_root is skipped (the next valid sample is used) and named once in train.log; past this many different ones the run stops at the next report with an error naming the count (a folder of broken files is a data problem, not noise). -1: no limit. Loader 'torch' (or 'auto' when it picks torch): DALI stops at the first corrupt image."""
    loader: str = "torch"
    """Who reads and decodes the 'recordio' and 'folder' images: 'torch' (PIL in DataLoader workers; a corrupt image is skipped and counted), 'dali' (NVIDIA DALI, the 'dali' extra: decoded on the GPU on CUDA, on the CPU otherwise, with num_workers threads; a corrupt image stops the run with an error naming its batch) or 'auto' (dali when installed and the run is on CUDA, else torch). Same order, augmentation and resume either way."""
    drop_last: bool = False
    """Drop each epoch's last partial batch; by default it is trained on (the head accepts unequal per-rank batches). Sampler 'random' only, outside strategy 'pipeline': P x K batches are always whole, and a pipeline always drops a partial one (its micro-batches divide the batch)."""
    sampler: str = "random"
    """Order of the training images: 'random' (a shuffled pass over the data per epoch) or 'pk' (every global micro-batch holds P identities x pk_instances images, for the triplet loss; identities with fewer images are topped up with repeats)."""
    pk_instances: int = 4
    """K of sampler='pk': images per identity in a global batch (batch_size * ranks must be a multiple)."""
    random_erasing: float = 0.0
    """Probability of erasing a random rectangle of each training image (re-ID augmentation, 0.5 in the strong baseline); 0: off."""
    flip_prob: float = 0.5
    """Probability of mirroring each training image (faces and people: 0.5, as arcface_torch; 0 for data whose mirror is another identity, such as glyphs)."""

    # ------------------------------------------------------------------ model
    backbone: str = "tiny"
    """Backbone name: iresnet18/34/50/100, mobilefacenet, mbf/mbf_large (arcface_torch's), resnet50 (re-ID) or tiny (CPU demos)."""
    embedding_dim: int = 128
    """Width of the embeddings the backbone produces and the head classifies (at most 65536)."""
    neck: str = "auto"
    """resnet50 only: 'bnneck' (a BatchNorm1d between the pooled feature and the embedding; the triplet loss reads the feature before it) or 'none'; 'auto': the backbone's own (bnneck for resnet50)."""

    # ------------------------------------------------------------------ head
    margin: str = "arcface"
    """Margin of the classifier: arcface, cosface, sphereface, combined, adaface, magface, normsoftmax or softmax."""
    scale: float = 32.0
    """Logit scale s of arcface, cosface, combined, adaface, magface and normsoftmax (the papers train faces with 64)."""
    m: float = -1.0
    """Margin m: angular (arcface, default 0.5), additive cosine (cosface, default 0.35), AdaFace's m (default 0.4) or the integer multiplier (sphereface, default 4); negative: the margin's default."""
    m1: float = 1.0
    """Multiplicative angular margin m1 of 'combined': cos(m1*theta + m2) - m3."""
    m2: float = 0.5
    """Additive angular margin m2 of 'combined'."""
    m3: float = 0.0
    """Additive cosine margin m3 of 'combined'."""
    easy_margin: bool = False
    """ArcFace: apply the margin only where cos(theta) > 0."""
    sphereface_lambda: float = 0.0
    """SphereFace annealing: target logit = (lambda*cos + psi) / (1 + lambda); 0 is the pure margin."""
    adaface_h: float = 0.333
    """AdaFace: h, the concentration of the normalised feature norm (quality) z = clip(h*(norm - mean)/std, -1, 1)."""
    adaface_momentum: float = 0.01
    """AdaFace: momentum of the running mean and std of the feature norms (all ranks share them; saved in checkpoints)."""
    magface_l_a: float = 10.0
    """MagFace: lower bound l_a of the feature norm a."""
    magface_u_a: float = 110.0
    """MagFace: upper bound u_a of the feature norm a."""
    magface_l_m: float = 0.45
    """MagFace: angular margin at a = l_a."""
    magface_u_m: float = 0.8
    """MagFace: angular margin at a = u_a."""
    magface_lambda_g: float = 35.0
    """MagFace: weight lambda_g of the norm regulariser a/u_a^2 + 1/a."""
    subcenters: int = 1
    """Sub-center ArcFace: centres per class (the class logit is the max over them); 1: one centre per class."""
    interclass_filter_threshold: float = 0.0
    """Inter-class filtering: leave out of each sample's softmax the negative classes whose cosine to its target centre exceeds this, in (0, 1]; 0: off."""
    sample_rate: float = 1.0
    """Partial FC: fraction of each shard's negative classes sampled per step (1.0: all classes, exact softmax)."""
    chunk_size: int = 0
    """Walk each shard's classes this many at a time to bound activation memory (logits never stored); 0: all at once; -1: auto (the largest chunk whose logits fit 64 MiB). head_impl 'torch' (or 'auto' when it picks torch): the GPU paths hold no logits to chunk."""
    head_impl: str = "auto"
    """Which code computes the head's loss: auto (on CUDA with Triton, the fastest of triton, gemm and torch, timed once per workload and cached; else torch; SHARDFC_HEAD_IMPL names one instead), triton (a fused forward kernel; no [B, C] logits; needs CUDA and pip install 'shardfc[gpu]'), gemm (cuBLAS GEMMs over class chunks with Triton epilogues; same needs), torch (the reference)."""
    label_smoothing: float = 0.0
    """Label smoothing epsilon over all classes."""
    triplet_weight: float = 0.0
    """Weight of a batch-hard triplet loss over the global batch added to the classification loss (1.0 in the re-ID strong baseline; use sampler='pk'); 0: off. Needs a backbone with a neck (resnet50, tiny)."""
    triplet_margin: float = 0.3
    """Margin of the triplet loss's hinge max(0, d(a,p) - d(a,n) + margin)."""
    triplet_soft: bool = False
    """Soft-margin triplet loss log(1 + exp(d(a,p) - d(a,n))) instead of the hinge (triplet_margin is then unused)."""
    head_dtype: str = "float32"
    """Storage dtype of the class centres and their optimizer state: float32, bfloat16 or float16 (updates computed in fp32, rounded once)."""
    head_rounding: str = "nearest"
    """How a bf16/fp16 head's fp32 update is rounded back: nearest or stochastic (unbiased, seeded by --seed)."""
    sparse_grad: bool = False
    """Partial FC: keep only the sampled rows' weight gradient (no [n_local, D] gradient); needs sample_rate < 1 and amp != fp16."""
    head_idle_rows: str = "exact"
    """Partial FC: exact (a row a step did not sample is brought to where the dense optimizer would have it, momentum, weight decay, AdamW's moments, when next read: trains as a dense optimizer, at the row-sparse cost plus 4 bytes a row) or lazy (it waits, unchanged, for its next sample; cost 3.6 / 6.1 points of hard-pair accuracy at sample_rate 0.1 / 0.05 in docs/accuracy.md)."""

    # ------------------------------------------------------------------ optim
    optimizer: str = "sgd"
    """Optimizer of backbone and head: 'sgd' or 'adamw'."""
    lr: float = 0.1
    """Peak learning rate (reached after warmup_steps)."""
    momentum: float = 0.9
    """SGD momentum."""
    head_momentum: float = -1.0
    """SGD momentum of the head alone; negative: momentum's. 0 with head_dtype bfloat16 keeps 2·D bytes per class at rest (no momentum buffer): the cheapest head shardfc plan knows."""
    weight_decay: float = 5e-4
    """Weight decay (SGD: L2 added to the gradient; AdamW: decoupled)."""
    nesterov: bool = False
    """SGD: Nesterov momentum."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas 'beta1 beta2'."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 5.0
    """Clip the backbone's gradient norm to this value, as insightface's arcface_torch does; 0: no clipping. The head is clipped only with head_grad_clip (before 0.2 this clipped the head too)."""
    head_grad_clip: float = 0.0
    """Clip the head's gradient by its global norm over all shards to this value; 0 (default): the head is not clipped. Set it to grad_clip for what grad_clip did before 0.2. Needs the head's gradient stored (head_update 'optimizer')."""
    head_update: str = "auto"
    """Who applies the head's optimizer step: 'fused' (the head's backward, row by row as it forms the gradient, which is then never stored: no [n, D] gradient written, cleared or read; SGD or AdamW on CUDA with head_impl triton/gemm, grad_accum 1, no fp16 loss scaling, no head_grad_clip, nearest rounding, one micro-batch per pipeline step), 'optimizer' (the gradient stored, then the optimizer's step) or 'auto' (fused where all that holds, else optimizer)."""
    cuda_graph: str = "off"
    """'head': the head's training step (forward, backward and the fused update) captured once as a CUDA graph and replayed every step (shardfc.head.capture), so the host issues one call instead of hundreds of kernel launches; needs CUDA, one process, strategy ddp, the fused head update (head_update auto or fused, SGD or AdamW, head_impl not torch, no fp16, no head_grad_clip, grad_accum 1); Partial FC too, but not with sparse_grad or with adamw and head_idle_rows exact. 'off' (default, until measured on a GPU): every step eager."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (the step's batch is grad_accum * batch_size * nproc)."""

    # ------------------------------------------------------------------ schedule
    batch_size: int = 64
    """Images per rank per micro-batch."""
    max_steps: int = 0
    """Optimizer steps to train; 0: derived from epochs."""
    epochs: int = 8
    """Passes over the training set, used when max_steps is 0."""
    scheduler: str = "poly"
    """Learning-rate decay after warm-up, per step: 'poly' ((1 - t)^poly_power) or 'cosine'."""
    poly_power: float = 2.0
    """Exponent of the poly schedule."""
    warmup_steps: int = 200
    """Steps of linear learning-rate warm-up from 0."""

    # ------------------------------------------------------------------ run
    strategy: str = "ddp"
    """How the run spreads over processes and devices: 'ddp' (one process per rank, spawned with --nproc or by torchrun; backbone in DistributedDataParallel, one head shard per rank), 'dp' (one process; backbone in nn.DataParallel over every visible CUDA device, one head shard per device; needs >= 2 GPUs; batch_size is per GPU), 'horovod' (launched by `horovodrun -np N`; backbone optimizer in hvd.DistributedOptimizer, one head shard per rank over Horovod's collectives) or 'pipeline' (nproc = pipeline_stages x replicas processes: the backbone cut into pipeline stages, each stage data-parallel over the replicas; the head sharded over the last stage's ranks)."""
    amp: str = "auto"
    """Mixed precision: 'auto' (bf16 autocast on a CUDA GPU that has bf16, fp16 autocast + loss scaling on one that has not, none on the CPU), 'none', 'bf16' (autocast) or 'fp16' (autocast + loss scaling; on CPU it falls back to bf16 where the CPU has native bf16, else to fp32)."""
    channels_last: bool = True
    """On CUDA, hold a convolutional backbone and its input batches in channels_last (NHWC) memory format, the layout cuDNN's tensor-core convolutions run in (ignored on the CPU, by backbones without 2-D convolutions and under strategy 'horovod', whose collectives take contiguous tensors only; under strategy 'pipeline' each stage with convolutions holds its weights so and converts its input, while the activations crossing the stages stay NCHW); --no-channels-last: contiguous NCHW."""
    compile: bool = False
    """torch.compile the backbone (in place, nn.Module.compile: checkpoints keep the plain parameter names; under strategy 'pipeline', each rank's stage; refused by 'dp', whose replicas would not run it); the first steps are slower while it compiles."""
    seed: int = 0
    """Seed of the model initialisation, data order, augmentation and the synthetic dataset (0 to 2**63 - 1)."""
    pipeline_stages: int = 2
    """Strategy 'pipeline': stages the backbone is cut into; nproc must be a multiple of it (nproc / pipeline_stages data-parallel replicas)."""
    pipeline_schedule: str = "1f1b"
    """Strategy 'pipeline': 'gpipe' (all forwards, then all backwards) or '1f1b' (one forward, one backward in the steady state: fewer live activations; needs micro_batches >= pipeline_stages)."""
    micro_batches: int = 2
    """Strategy 'pipeline': micro-batches each rank's batch is cut into (batch_size must be a multiple of it)."""
    split_points: List[str] = field(default_factory=list)
    """Strategy 'pipeline': backbone segments to cut after (pipeline_stages - 1 names, e.g. 'layer2', or 'layer3.14' after block 14 of layer3); empty: those that balance the stages' parameter counts (between blocks too)."""
    micro_batch_stats: bool = False
    """Strategy 'pipeline': let BatchNorm normalise each micro-batch with its own statistics (as under grad_accum); without it, micro_batches > 1 with a training-mode BatchNorm is refused."""
    nproc: int = 2
    """Processes to spawn on this machine (strategies 'ddp' and 'pipeline'; ignored under torchrun, whose environment decides; refused as a flag by 'dp', which is one process, and by 'horovod', whose processes horovodrun starts)."""
    device: str = "auto"
    """'auto' (one CUDA device per rank when available, else CPU), 'cpu' or 'cuda'."""
    threads: int = 0
    """Intra-op CPU threads per process (at most 1024); 0: OMP_NUM_THREADS when set, else the usable cores divided by the training processes on this machine."""
    output_dir: str = "shardfc_runs/synthetic"
    """Run folder: checkpoints/, metrics.csv, train.log, config.toml (default: shardfc_runs/<preset or dataset>)."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint in output_dir (if any); 'none': start fresh (refused if output_dir holds checkpoints); or a checkpoint folder, or a run folder (its newest complete checkpoint)."""
    log_every: int = 50
    """Log loss, learning rate and throughput every this many steps."""
    progress: bool = True
    """Show a progress bar on rank 0 when stderr is a terminal (tqdm if installed)."""
    profile: bool = False
    """Write profile/rank<R>.json at the end of the run, one per process: each step's time, samples and bytes communicated (counted at the collectives, DDP's gradient buckets and Horovod's gradient all-reduces included), and the process's peak memory (what `shardfc bench --recipes` reads)."""
    eval_every: int = 250
    """Evaluate every this many steps; 0: only at the end."""
    ckpt_every: int = 500
    """Save a checkpoint every this many steps; 0: only at the end."""
    keep_last: int = 3
    """Keep this many newest checkpoints, deleting older complete ones; 0: keep all."""
    save_on_signal: bool = True
    """On SIGINT / SIGTERM, stop after the current step on every rank and save a checkpoint there (--no-save-on-signal: stop without saving)."""
    pg_timeout: float = 300.0
    """Seconds a torch.distributed collective (and joining the process group) may wait for its peers before the run fails, so that a dead or stuck peer does not hang the others; must exceed rank 0's longest evaluation, during which the other ranks wait (at most 1e9)."""
    trust_checkpoint: bool = False
    """Resume from a checkpoint even if its files need full unpickling (written by shardfc before checkpoint format 2, or not by shardfc): unpickling can run arbitrary code, so only for checkpoints you trust."""

    # ------------------------------------------------------------------ eval
    val_bins: List[str] = field(default_factory=list)
    """insightface verification .bin files (lfw.bin, cfp_fp.bin, agedb_30.bin, ...) evaluated during training, each reported under its file's stem (two of one stem are refused), with at least 10 pairs each."""
    reid_root: str = ""
    """Re-ID dataset root with query/gallery splits (e.g. Market-1501), evaluated during training."""
    synthetic_val_pairs: int = 1000
    """Held-out verification pairs of the synthetic dataset (unseen images of unseen identities), at least 10 (the protocol's folds) and at most as many as fit in 8 GiB of images (28,532 at 112x112); 0: none."""
    eval_batch_size: int = 256
    """Images per forward pass during evaluation."""
    eval_flip: bool = True
    """Add the embedding of the mirrored image at evaluation (insightface protocol)."""

    # ------------------------------------------------------------------ classes (fine-tuning, growing)
    init_from: str = ""
    """Start a new run from a trained model: a shardfc checkpoint folder (a step_* folder, or a run folder whose newest checkpoint is taken), e.g. an `shardfc import-arcface` output, or a `shardfc export` TorchScript file (its weights read without running it; it holds no head). Its backbone is loaded; its head too where its classes are this dataset's (grown by the new ones), else a new head is built for the dataset's classes (--head-init). Ignored when --resume finds a checkpoint of this run."""
    head_init: str = "random"
    """Rows of classes the checkpoint has no row for (a fine-tuning run's, or identities added since): 'random' (seeded N(0, 0.01)) or 'imprint' (the normalised mean embedding of the class's images under the loaded backbone: one sharded pass over the data before the first step)."""
    head_warmup_steps: int = 0
    """Train only the head for this many first steps: the backbone frozen (eval mode, no gradient, no update; a pipeline's stages: eval mode, no update), then trained as usual."""
    backbone_lr_mult: float = 1.0
    """The backbone's learning rate is lr times this (the head's is lr): below 1 to fine-tune a trained backbone gently."""
    on_missing_classes: str = "error"
    """When the checkpoint has classes the dataset lacks (vanished or renamed identities, or no class names to tell): 'error' (refuse, naming them), 'keep' (keep their rows, without images: no identity changes row) or 'fresh' (a new head for the dataset's classes; only the backbone is kept)."""
    rename_classes: str = ""
    """A file of identities renamed since the checkpoint: one 'old name<TAB>new name' per line (# comments allowed); each keeps its row under its new name, in this run's checkpoints too. Read with --resume and --init-from."""

    # ------------------------------------------------------------------ derived helpers
    def backbone_params(self, image_size: Sequence[int]) -> Dict[str, Any]:
        """Keyword arguments of :func:`shardfc.models.build_backbone` for ``self.backbone`` beyond the
        embedding width, for inputs of ``image_size`` ``(H, W)``: every strategy's backbone, a pipeline's
        probe and an export rebuild it from these."""
        sized = self.backbone in ("tiny", "glyphnet")  # built for the run's image size
        kwargs: Dict[str, Any] = {"input_size": tuple(int(x) for x in image_size)} if sized else {}
        if self.neck != "auto":
            kwargs["neck"] = self.neck
        return kwargs

    def margin_params(self) -> Dict[str, Any]:
        """Keyword arguments of :func:`shardfc.head.margins.build_margin` for ``self.margin``; a
        negative ``m`` takes the margin class's own default (the defaults live there, once)."""
        from shardfc.head.margins import MARGINS  # imports torch: only when a margin is built

        name = self.margin
        if self.m < 0 and name in ("arcface", "cosface", "sphereface", "adaface"):
            m = inspect.signature(MARGINS[name]).parameters["margin"].default
        else:
            m = int(self.m) if name == "sphereface" else self.m
        if name == "arcface":
            return {"scale": self.scale, "margin": m, "easy_margin": self.easy_margin}
        if name == "cosface":
            return {"scale": self.scale, "margin": m}
        if name == "sphereface":
            return {"margin": m, "lambda_": self.sphereface_lambda}
        if name == "combined":
            return {"scale": self.scale, "m1": self.m1, "m2": self.m2, "m3": self.m3}
        if name == "normsoftmax":
            return {"scale": self.scale}
        if name == "adaface":
            return {"scale": self.scale, "margin": m, "h": self.adaface_h, "momentum": self.adaface_momentum}
        if name == "magface":
            return {"scale": self.scale, "l_a": self.magface_l_a, "u_a": self.magface_u_a, "l_m": self.magface_l_m,
                    "u_m": self.magface_u_m, "lambda_g": self.magface_lambda_g}
        return {}

    def validate(self, *, evaluations: bool = True) -> "TrainConfig":
        """Check value ranges and combinations; raise :class:`ConfigError` naming the field and value.

        ``evaluations``: also check the plan of evaluation targets (distinct names, enough pairs:
        :func:`~shardfc.train.config.targets.plan_targets`); off for a saved config read without them.
        """
        _finite_numbers(self)
        _choice(self, "dataset", ("synthetic", "folder", "recordio", "list", "market1501"))
        _choice(self, "sampler", ("random", "pk"))
        _choice(self, "loader", ("torch", "dali", "auto"))
        if self.loader == "dali" and self.dataset not in ("recordio", "folder"):
            raise ConfigError(f"loader='dali' reads the 'recordio' and 'folder' datasets, not dataset={self.dataset!r}")
        if self.loader == "dali":
            from shardfc.train.loader.dali_loader import dali_missing

            if dali_missing() is not None:
                raise ConfigError(f"loader='dali': {dali_missing()}")
        _choice(self, "neck", ("auto", "bnneck", "none"))
        self.margin = MARGIN_ALIASES.get(self.margin, self.margin)
        _choice(self, "margin", ("arcface", "cosface", "sphereface", "combined", "adaface", "magface", "normsoftmax",
                                 "softmax"))
        _choice(self, "optimizer", ("sgd", "adamw"))
        _choice(self, "scheduler", ("poly", "cosine"))
        _choice(self, "strategy", STRATEGIES)
        _choice(self, "pipeline_schedule", PIPELINE_SCHEDULES)
        _choice(self, "amp", ("auto", "none", "bf16", "fp16"))
        _choice(self, "device", ("auto", "cpu", "cuda"))
        _choice(self, "head_impl", ("auto", "triton", "gemm", "torch"))
        _choice(self, "head_update", ("auto", "fused", "optimizer"))
        _choice(self, "cuda_graph", ("off", "head"))
        for name in ("synthetic_identities", "synthetic_images_per_identity", "embedding_dim", "batch_size",
                     "grad_accum", "nproc", "log_every", "eval_batch_size", "subcenters", "pipeline_stages",
                     "micro_batches"):
            _at_least(self, name, 1)
        _at_least(self, "max_corrupt_images", -1)
        if self.chunk_size < -1:
            raise ConfigError(f"chunk_size must be >= 1, 0 (no chunking) or -1 (auto), got {self.chunk_size!r}")
        for name in ("num_workers", "threads", "max_steps", "epochs", "warmup_steps", "eval_every",
                     "ckpt_every", "keep_last", "synthetic_val_pairs", "seed"):
            _at_least(self, name, 0)
        for name in ("lr", "scale", "eps", "pg_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.pg_timeout > MAX_PG_TIMEOUT:  # past datetime.timedelta's range: every rank's group init overflowed
            raise ConfigError(f"pg_timeout must be at most {MAX_PG_TIMEOUT:.0e} seconds (31 years), got {self.pg_timeout!r}")
        if self.seed > MAX_SEED:  # shardfc.checks.check_seed's bound, in the config's words
            raise ConfigError(f"seed must be at most 2**63 - 1 (torch's generators take a signed 64-bit seed), "
                              f"got {self.seed!r}")
        if self.threads > MAX_THREADS:  # OpenMP fails to make them, or the process dies outright
            raise ConfigError(f"threads must be at most {MAX_THREADS} (0: one per core), got {self.threads!r}")
        for name in ("weight_decay", "grad_clip", "head_grad_clip", "poly_power", "sphereface_lambda"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not self.head_momentum < 1.0:
            raise ConfigError(f"head_momentum must be in [0, 1), or negative for momentum's, got {self.head_momentum!r}")
        if self.head_momentum >= 0 and self.optimizer != "sgd":
            raise ConfigError(f"head_momentum applies to optimizer='sgd', got optimizer={self.optimizer!r} "
                              f"(head_momentum={self.head_momentum!r})")
        _validate_reid(self)
        _choice(self, "head_dtype", ("float32", "bfloat16", "float16"))
        _choice(self, "head_rounding", ("nearest", "stochastic"))
        _choice(self, "head_idle_rows", ("exact", "lazy"))
        if self.sparse_grad and self.amp == "fp16":
            raise ConfigError("sparse_grad does not work with amp='fp16' (the loss scaler unscales .grad only): "
                              "use --amp bf16 or none")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if not 0.0 <= self.interclass_filter_threshold <= 1.0:
            raise ConfigError(
                f"interclass_filter_threshold must be in (0, 1] (0: off), got {self.interclass_filter_threshold!r}"
            )
        from shardfc.head.validation import check_head_options  # the head's own checks, once

        try:
            check_head_options(sample_rate=self.sample_rate, sparse_grad=self.sparse_grad, subcenters=self.subcenters,
                               label_smoothing=self.label_smoothing,
                               interclass_filter_threshold=self.interclass_filter_threshold or None)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.image_size and (len(self.image_size) != 2 or min(self.image_size) < 1
                                or max(self.image_size) > MAX_IMAGE_SIDE):
            raise ConfigError(f"image_size must be empty or two ints 'H W' in [1, {MAX_IMAGE_SIDE}], "
                              f"got {self.image_size!r}")
        if self.embedding_dim > MAX_EMBEDDING_DIM:
            raise ConfigError(f"embedding_dim must be <= {MAX_EMBEDDING_DIM}, got {self.embedding_dim!r}")
        if self.max_steps == 0 and self.epochs == 0:
            raise ConfigError("max_steps and epochs are both 0: set one of them to say how long to train")
        if self.margin == "sphereface" and self.m >= 0 and (self.m != int(self.m) or self.m < 1):
            raise ConfigError(f"m must be an integer >= 1 for margin='sphereface', got {self.m!r}")
        from shardfc.head.margins import build_margin  # the margin's own checks, named by our flags

        try:
            build_margin(self.margin, **self.margin_params())
        except (TypeError, ValueError) as e:
            given = ", ".join(f"{k}={getattr(self, k)!r} (--{k.replace('_', '-')})" for k in _MARGIN_FIELDS[self.margin])
            raise ConfigError(f"margin={self.margin!r} with {given}: {e}") from None
        if self.dataset == "synthetic" and self.data_root:
            raise ConfigError(
                f"data_root={self.data_root!r} is set but dataset='synthetic' reads no files: pass --dataset folder "
                "(one sub-folder per identity) or --dataset list"
            )
        if self.dataset == "recordio" and not self.data_root:
            raise ConfigError("dataset='recordio' needs data_root (the folder with train.rec and train.idx, or the .rec)")
        if self.dataset == "folder" and not self.data_root:
            raise ConfigError("dataset='folder' needs data_root (the folder with one sub-folder per identity)")
        if self.dataset == "market1501" and not self.data_root:
            raise ConfigError("dataset='market1501' needs data_root (the folder holding bounding_box_train/)")
        if self.dataset == "list" and not self.list_file:
            raise ConfigError("dataset='list' needs list_file (lines of 'path label')")
        if not self.output_dir:
            raise ConfigError("output_dir must not be empty")
        if self.strategy == "pipeline":
            self._validate_pipeline()
        if self.strategy == "dp" and self.compile:
            raise ConfigError(
                "compile=True is not supported by strategy='dp': nn.DataParallel's replicas copy the module's "
                "compiled forward, which runs the original module with the first device's weights; use --strategy ddp"
            )
        if self.head_update == "fused":
            why = self.head_update_not_fusable()
            if why is not None:
                raise ConfigError(f"head_update='fused': {why}; use head_update 'auto' or 'optimizer'")
        if self.cuda_graph == "head":
            self._validate_cuda_graph()
        _validate_classes(self)
        if evaluations:  # before training, on every rank, not at the first evaluation on rank 0
            from shardfc.train.config.targets import plan_targets  # imports torch: only when validating

            try:
                plan_targets(self)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return self

    def head_update_not_fusable(self, device_type: Optional[str] = None) -> Optional[str]:
        """Why the head's backward cannot apply its optimizer's step in this run (None when it can):
        the conditions of ``head_update='fused'`` that the configuration decides (``device_type``:
        the run's device, when known)."""
        if self.grad_accum > 1:
            return f"grad_accum={self.grad_accum} (several backward passes add into one step's gradient)"
        if self.strategy == "pipeline" and self.micro_batches > 1:
            return f"strategy='pipeline' with micro_batches={self.micro_batches} (a backward per micro-batch)"
        if self.head_grad_clip > 0:
            return f"head_grad_clip={self.head_grad_clip} (clipping reads the stored gradient)"
        if self.amp == "fp16":
            return "amp='fp16' (the loss scaler unscales and checks the stored gradient)"
        if self.head_rounding != "nearest" and self.head_dtype != "float32":
            return f"head_rounding={self.head_rounding!r} (the fused update rounds to nearest)"
        if self.head_impl == "torch":
            return "head_impl='torch' (the fused update is the GPU implementations')"
        if device_type == "cpu" or (device_type is None and self.device == "cpu"):
            return "the run is on the CPU (the fused update needs CUDA)"
        return None

    def _validate_cuda_graph(self) -> None:
        """``cuda_graph='head'``: what the configuration alone says against capturing the head's step
        (the run's device and its optimizer are the builder's: :func:`~shardfc.train.builder.factory.build_head_step`)."""
        if self.strategy != "ddp":
            raise ConfigError(f"cuda_graph='head' is not supported by strategy={self.strategy!r}: the captured step is "
                              "one head on one device in one process (strategy ddp with nproc 1)")
        why = None
        if self.nproc > 1:
            why = f"nproc={self.nproc} (a head sharded over ranks exchanges batch sizes through the host)"
        elif self.sparse_grad:  # Partial FC's alone (validate checked that before)
            why = "sparse_grad (each backward's compact gradient goes to host-side lists; the fused update needs none)"
        elif self.sample_rate < 1.0 and self.optimizer == "adamw" and self.head_idle_rows == "exact":
            why = ("optimizer='adamw' with head_idle_rows='exact' under Partial FC (its catch-up iterates a number of "
                   "missed steps the host counts; use sgd, or head_idle_rows lazy)")
        elif self.head_update == "optimizer":
            why = "head_update='optimizer' (the update must be inside the captured step: head_update auto or fused)"
        else:
            why = self.head_update_not_fusable()
        if why is not None:
            raise ConfigError(f"cuda_graph='head': {why}; use cuda_graph 'off'")

    def _validate_pipeline(self) -> None:
        if self.pipeline_stages < 2:
            raise ConfigError(f"pipeline_stages must be >= 2 for strategy='pipeline' (one stage: use ddp), got {self.pipeline_stages}")
        if self.batch_size % self.micro_batches:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by micro_batches={self.micro_batches}: pipeline "
                "micro-batches have a fixed shape"
            )
        if self.pipeline_schedule == "1f1b" and self.micro_batches < self.pipeline_stages:
            raise ConfigError(
                f"pipeline_schedule='1f1b' needs micro_batches >= pipeline_stages, got micro_batches={self.micro_batches} "
                f"for pipeline_stages={self.pipeline_stages} (raise --micro-batches, or --pipeline-schedule gpipe)"
            )
        for name in PIPELINE_REFUSES:
            value, default = getattr(self, name), FIELDS[name].default
            if value != default:
                raise ConfigError(
                    f"{name}={value!r} is not supported by strategy='pipeline' (its last stage hands the head the "
                    "embeddings only, not the feature before the neck the triplet loss reads): use --strategy ddp"
                )
        if self.split_points and len(self.split_points) != self.pipeline_stages - 1:
            raise ConfigError(
                f"split_points={list(self.split_points)} names {len(self.split_points)} cut(s), but pipeline_stages="
                f"{self.pipeline_stages} needs {self.pipeline_stages - 1}"
            )


DEFAULT_OUTPUT_DIR = "shardfc_runs/synthetic"

#: The fields strategy 'pipeline' refuses at any value but their default (the triplet loss's), each
#: with a one-line error naming it; every other field reaches the pipeline's parts as it reaches
#: ddp's (one builder: :func:`shardfc.train.builder.factory.build_model`; tests/train/builder/test_builder.py).
PIPELINE_REFUSES = ("triplet_weight", "triplet_margin", "triplet_soft")

#: The fields that name files or folders (``val_bins`` is a list of them).
PATH_FIELDS = ("data_root", "list_file", "output_dir", "reid_root", "val_bins", "init_from", "rename_classes")


def absolute_paths(cfg: TrainConfig, base: "str | os.PathLike[str] | None" = None) -> TrainConfig:
    """``cfg`` with its relative paths made absolute against ``base`` (default: the working folder).

    A run stores its config in checkpoints and ``config.toml``; with absolute paths ``shardfc
    eval`` and a resume find the data and evaluation sets from any folder. A relative ``val_bins``
    entry is resolved as the evaluation looks it up: in ``base`` if there, else beside ``data_root``.
    """
    root = Path(os.path.abspath(base if base is not None else os.getcwd()))

    def resolve(path: str) -> str:
        return str(Path(os.path.normpath(root / Path(path).expanduser()))) if path else path

    updates: Dict[str, Any] = {name: resolve(getattr(cfg, name)) for name in PATH_FIELDS if name != "val_bins"}
    bins = []
    for path in cfg.val_bins:
        here = resolve(path)
        beside = os.path.join(updates["data_root"], path) if cfg.data_root and not os.path.isabs(path) else ""
        bins.append(os.path.normpath(beside) if beside and not os.path.exists(here) and os.path.exists(beside) else here)
    updates["val_bins"] = bins
    return dataclasses.replace(cfg, **updates)

#: The settings read only when a run starts from a checkpoint: how its classes meet the dataset's.
CHECKPOINT_SETTINGS = ("head_init", "on_missing_classes", "rename_classes")


def _evaluates(cfg: "TrainConfig") -> bool:
    """The run has an evaluation target (the one rule :func:`~shardfc.train.config.targets.asked_targets`)."""
    from shardfc.train.config.targets import asked_targets  # imports torch: only when such a flag is given

    bins, reid_root, synthetic_pairs = asked_targets(cfg, None, None, None)
    return bool(bins or reid_root or synthetic_pairs)


_TARGETS = "an evaluation target (--val-bins, --reid-root, or --synthetic-val-pairs > 0 with dataset 'synthetic')"

#: The flags a run reads only in some configurations: ``field -> (whether this config reads it, what
#: reads it, the setting that decides, or a function of the config naming it)``. A flag given for a
#: field the run does not read is refused by :func:`check_flags_read` rather than dropped (a value in a
#: config file or a preset is not: a run's saved config.toml holds every field).
_READ_WHEN = {
    "momentum": (lambda c: c.optimizer == "sgd", "optimizer 'sgd'", "optimizer"),
    "nesterov": (lambda c: c.optimizer == "sgd", "optimizer 'sgd'", "optimizer"),
    "betas": (lambda c: c.optimizer == "adamw", "optimizer 'adamw'", "optimizer"),
    "eps": (lambda c: c.optimizer == "adamw", "optimizer 'adamw'", "optimizer"),
    "poly_power": (lambda c: c.scheduler == "poly", "scheduler 'poly'", "scheduler"),
    "pipeline_stages": (lambda c: c.strategy == "pipeline", "strategy 'pipeline'", "strategy"),
    "pipeline_schedule": (lambda c: c.strategy == "pipeline", "strategy 'pipeline'", "strategy"),
    "micro_batches": (lambda c: c.strategy == "pipeline", "strategy 'pipeline'", "strategy"),
    "split_points": (lambda c: c.strategy == "pipeline", "strategy 'pipeline'", "strategy"),
    "micro_batch_stats": (lambda c: c.strategy == "pipeline", "strategy 'pipeline'", "strategy"),
    # dp is one process driving every visible GPU; horovodrun's -np decides horovod's processes
    "nproc": (lambda c: c.strategy in ("ddp", "pipeline"), "strategy 'ddp' or 'pipeline'", "strategy"),
    "list_file": (lambda c: c.dataset == "list", "dataset 'list'", "dataset"),
    # read when the run starts from a checkpoint: a resume (one 'auto' may find: warned at run time if
    # it finds none) or --init-from
    **{name: (lambda c: bool(c.init_from) or c.resume.strip().lower() != "none",
              "a checkpoint to start from (--init-from, or a --resume other than 'none')", "resume")
       for name in CHECKPOINT_SETTINGS},
    "synthetic_identities": (lambda c: c.dataset == "synthetic", "dataset 'synthetic'", "dataset"),
    "synthetic_images_per_identity": (lambda c: c.dataset == "synthetic", "dataset 'synthetic'", "dataset"),
    # 0 (no synthetic evaluation) is taken on any dataset: scripts share it across datasets to turn it off
    "synthetic_val_pairs": (lambda c: c.dataset == "synthetic" or c.synthetic_val_pairs == 0, "dataset 'synthetic'",
                            "dataset"),
    "eval_flip": (_evaluates, _TARGETS, "val_bins"),
    "eval_batch_size": (lambda c: _evaluates(c) or c.head_init == "imprint", f"{_TARGETS} or --head-init imprint",
                        "val_bins"),
    "head_rounding": (lambda c: c.head_dtype != "float32", "a bfloat16 or float16 head", "head_dtype"),
    # 0 (evaluate at the end only) is taken anywhere, as synthetic_val_pairs 0 is
    "eval_every": (lambda c: c.eval_every == 0 or _evaluates(c), _TARGETS, "val_bins"),
    "epochs": (lambda c: c.max_steps == 0, "max_steps 0 (a run as long as its epochs)", "max_steps"),
    "drop_last": (lambda c: c.sampler == "random" and c.strategy != "pipeline",
                  "sampler 'random' outside strategy 'pipeline' (P x K batches are always whole, and so are a "
                  "pipeline's, whose micro-batches divide them)",
                  lambda c: "sampler" if c.sampler != "random" else "strategy"),
    # the fused GPU paths hold no [B, n] logits to walk in chunks (docs/head.md)
    "chunk_size": (lambda c: c.head_impl in ("torch", "auto"), "head_impl 'torch' or 'auto'", "head_impl"),
    # DALI stops at the first corrupt image, naming its batch (docs/data.md)
    "max_corrupt_images": (lambda c: c.loader != "dali", "loader 'torch' or 'auto'", "loader"),
    "trust_checkpoint": (lambda c: bool(c.init_from) or c.resume.strip().lower() != "none",
                         "a checkpoint to start from (--init-from, or a --resume other than 'none')", "resume"),
    "head_idle_rows": (lambda c: c.sample_rate < 1, "Partial FC (sample_rate < 1)", "sample_rate"),
    "pk_instances": (lambda c: c.sampler == "pk", "sampler 'pk'", "sampler"),
    "triplet_soft": (lambda c: c.triplet_weight > 0, "the triplet loss (triplet_weight > 0)", "triplet_weight"),
    "triplet_margin": (lambda c: c.triplet_weight > 0 and not c.triplet_soft,
                       "the hinge triplet loss (triplet_weight > 0, no triplet_soft)", "triplet_weight"),
}


def check_flags_read(cfg: "TrainConfig", given: Sequence[str]) -> None:
    """Refuse a flag among ``given`` (field names set on the command line) that ``cfg`` does not read:
    ``--momentum`` beside ``--optimizer adamw``, ``--micro-batches`` under ddp, ``--easy-margin`` with
    cosface... (a ConfigError naming the flag and the setting that leaves it unread)."""
    margin_fields = {name for names in _MARGIN_FIELDS.values() for name in names}
    for name in given:
        if name in margin_fields and name not in _MARGIN_FIELDS[cfg.margin]:
            readers = sorted(m for m, names in _MARGIN_FIELDS.items() if name in names)
            raise ConfigError(f"--{name.replace('_', '-')} is read by margin {' / '.join(readers)}, not by this run's "
                              f"margin={cfg.margin!r}: remove it, or set --margin")
        if name in _READ_WHEN and not _READ_WHEN[name][0](cfg):
            _, what, decides = _READ_WHEN[name]
            decides = decides(cfg) if callable(decides) else decides
            raise ConfigError(f"--{name.replace('_', '-')} is read only with {what}, not by this run's "
                              f"{decides}={getattr(cfg, decides)!r}: remove it, or set --{decides.replace('_', '-')}")


#: The fields each margin reads (named in its errors).
_MARGIN_FIELDS = {
    "arcface": ("scale", "m", "easy_margin"), "cosface": ("scale", "m"), "sphereface": ("m", "sphereface_lambda"),
    "combined": ("scale", "m1", "m2", "m3"), "normsoftmax": ("scale",), "softmax": (),
    "adaface": ("scale", "m", "adaface_h", "adaface_momentum"),
    "magface": ("scale", "magface_l_a", "magface_u_a", "magface_l_m", "magface_u_m", "magface_lambda_g"),
}


def _validate_classes(cfg: TrainConfig) -> None:
    """The fine-tuning and class-growing options (docs/classes.md)."""
    _choice(cfg, "head_init", ("random", "imprint"))
    _choice(cfg, "on_missing_classes", ("error", "keep", "fresh"))
    _at_least(cfg, "head_warmup_steps", 0)
    if not cfg.backbone_lr_mult >= 0:
        raise ConfigError(f"backbone_lr_mult must be >= 0, got {cfg.backbone_lr_mult!r}")
    if cfg.strategy == "pipeline" and cfg.head_init == "imprint":
        raise ConfigError(
            "strategy='pipeline' cuts the backbone into stages: head_init='imprint' needs every image's embedding "
            "on the head's ranks, which a pipeline computes only inside its training schedule. Imprint with "
            "--strategy ddp (e.g. --max-steps 1, or the head-only warm-up), then --resume that run with "
            "--strategy pipeline: its checkpoint resumes under any strategy"
        )


def _validate_reid(cfg: TrainConfig) -> None:
    """The re-ID recipe's fields: the neck, the triplet loss, P x K sampling, random erasing."""
    from shardfc.models import WITH_FEATURES  # models import torch; keep this module light to import

    if cfg.neck != "auto" and cfg.backbone != "resnet50":
        raise ConfigError(f"neck={cfg.neck!r} applies to backbone='resnet50' only, got backbone={cfg.backbone!r}")
    for name in ("triplet_weight", "triplet_margin"):
        value = getattr(cfg, name)
        if not value >= 0:  # (infinity and NaN: refused before, by _finite_numbers)
            raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    if cfg.triplet_weight > 0 and cfg.backbone not in WITH_FEATURES:
        raise ConfigError(
            f"triplet_weight={cfg.triplet_weight!r} needs the feature before the backbone's neck, which only "
            f"{', '.join(WITH_FEATURES)} give; got backbone={cfg.backbone!r}"
        )
    if cfg.pk_instances < 2:
        raise ConfigError(f"pk_instances must be >= 2 (an identity needs a positive pair), got {cfg.pk_instances!r}")
    if not 0.0 <= cfg.random_erasing <= 1.0:
        raise ConfigError(f"random_erasing must be a probability in [0, 1], got {cfg.random_erasing!r}")
    if not 0.0 <= cfg.flip_prob <= 1.0:
        raise ConfigError(f"flip_prob must be a probability in [0, 1], got {cfg.flip_prob!r}")


def _finite_numbers(cfg: TrainConfig) -> None:
    """Every number of ``cfg`` is finite and within float32's range: TOML and the command line both
    spell NaN and infinity, and a NaN weight decay or an infinite learning rate trains to NaN
    without another word; 1e308 cannot reach an fp32 tensor at all."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{f.name} must be a finite number, got {value!r}")
            # past float32's largest a value cannot reach an fp32 tensor (lr 1e308 raised "value cannot be
            # converted to type float without overflow" in the first optimizer step)
            if isinstance(v, float) and abs(v) > FLOAT32_MAX:
                raise ConfigError(f"{f.name} must be within float32's range (|x| <= 3.4e38), got {value!r}")


def _choice(cfg: TrainConfig, name: str, choices: Sequence[str]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}{hint}")


def _at_least(cfg: TrainConfig, name: str, low: int) -> None:
    value = getattr(cfg, name)
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value!r}")


#: Each field's :class:`dataclasses.Field`, by name.
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
