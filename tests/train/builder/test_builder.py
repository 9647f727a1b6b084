"""One builder (issue 32): every ``TrainConfig`` field, under every strategy, either reaches the built
parts, or is refused for that strategy by a one-line ConfigError naming it, or is not a build field
(its category says what reads it). A field added without an entry in :data:`TABLE` fails
:func:`test_every_field_is_classified`.

How the parts are built, cheaply (``shardfc.train.builder.factory.build_model``, the factory ``build_run``
calls, without a dataset): ddp and pipeline in one spawned world of 2 ranks (ddp: DDP over both;
pipeline: 2 stages x 1 replica, the layout made once); dp in this process over two CPU "devices"
(its code path; dp itself is refused without two GPUs, checked too); horovod in one subprocess
where Horovod is installed (skipped otherwise). The CPU decides channels_last as CUDA does here
(:func:`_channels_last_anywhere`), so that field is seen too.

Each "reaches" entry is a probe (the field's value, and the fields it needs to matter) and a check
on the parts' summary (:func:`summarize`), which must hold for the probe and fail for the base
config: a builder that dropped the field fails it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn
from shardfc.train.config import STRATEGIES, ConfigError, TrainConfig

# ---------------------------------------------------------------------------- the table

#: What reads a field that shapes no built part (one word each, so the table stays honest):
CATEGORIES = {
    "data": "the dataset, sampler and loader (build_run, data.py): the same code under every strategy",
    "length": "the run's length: build_run's total_steps, which the factory's schedules get",
    "step": "the step (step.py's train_step / apply_gradients, pipeline_step), read every step",
    "layout": "how the run is spread over processes (the strategy, and the pipeline's own fields elsewhere)",
    "precision": "build_run's resolve_amp_dtype, once for every strategy: the factory's scaler, fused "
                 "update and pipeline specs, and the loop's autocast",
    "launch": "starting the processes and their device (cli, strategy.run_context, cpu.apply_threads)",
    "logging": "what is logged and profiled (loop, runlog, profile)",
    "checkpoint": "where and when the run saves and resumes (resume.py)",
    "eval": "evaluation during training (evaluate.py; under pipeline through the stages)",
    "classes": "the classes a started-from checkpoint decides (fine_tune.py, classes.py)",
    "contiguous": "off under strategy 'horovod', as the field's help says: Horovod's collectives take "
                  "contiguous tensors only (build.channels_last_wanted; logged on a GPU)",
}


@dataclass(frozen=True)
class Reaches:
    """The field reaches the built parts: ``check(summary, base summary)`` holds for ``probe`` (the
    field's value and what it needs) and not for the base config."""

    probe: Dict[str, Any]
    check: Callable[[dict, dict], bool]
    only: Tuple[str, ...] = STRATEGIES
    """Strategies where it shapes a part; elsewhere it is ``elsewhere``'s category."""
    elsewhere: str = ""
    refused: Dict[str, str] = field(default_factory=dict)
    """strategy -> the start of its one-line ConfigError for the field's probe value alone."""


@dataclass(frozen=True)
class Other:
    """Not a build field: ``category`` (:data:`CATEGORIES`) reads it, the same under every strategy but
    where ``refused`` says otherwise."""

    category: str
    refused: Dict[str, Tuple[Any, str]] = field(default_factory=dict)
    """strategy -> (a value it refuses, the start of its ConfigError)."""


def _margin(name: str, **attrs) -> Callable[[dict, dict], bool]:
    return lambda s, b: s["head"]["margin"] == name and all(s["head"]["margin_attrs"][k] == v for k, v in attrs.items())


def _head(**attrs) -> Callable[[dict, dict], bool]:
    return lambda s, b: all(s["head"][k] == v for k, v in attrs.items())


def _groups(which: Tuple[str, ...], **attrs) -> Callable[[dict, dict], bool]:
    return lambda s, b: all(s[w]["group"].get(k) == v for w in which for k, v in attrs.items())


BOTH = ("opt_backbone", "opt_head")
PIPE_ONLY = dict(only=("pipeline",), elsewhere="layout")
NO_TRIPLET = "is not supported by strategy='pipeline'"

TABLE: Dict[str, Any] = {
    # ---- data
    "dataset": Other("data"), "data_root": Other("data"), "list_file": Other("data"),
    "image_size": Reaches(dict(image_size=[20, 20]), lambda s, b: s["input_size"] == (20, 20)),
    "synthetic_identities": Other("data"), "synthetic_images_per_identity": Other("data"),
    "num_workers": Other("data"), "loader": Other("data"), "drop_last": Other("data"), "sampler": Other("data"),
    "pk_instances": Other("data"), "random_erasing": Other("data"), "flip_prob": Other("data"),
    "max_corrupt_images": Other("data"),  # the loop stops a run past it (tests/train/test_trainer.py)
    # ---- model
    "backbone": Reaches(dict(backbone="mobilefacenet", image_size=[]),
                        lambda s, b: s["input_size"] == (112, 112) and "stem.0.0.weight" in s["keys"]),
    "embedding_dim": Reaches(dict(embedding_dim=24), lambda s, b: s["embedding"] == 24 and s["head"]["embedding_dim"] == 24),
    "neck": Reaches(dict(backbone="resnet50", image_size=[32, 32], neck="none"),
                    lambda s, b: "layer4.0.conv1.weight" in s["keys"] and not any(k.startswith("neck.") for k in s["keys"])),
    # ---- head
    "margin": Reaches(dict(margin="cosface"), _margin("CosFace")),
    "scale": Reaches(dict(scale=20.0), _margin("ArcFace", s=20.0)),
    "m": Reaches(dict(m=0.3), _margin("ArcFace", m=0.3)),
    "m1": Reaches(dict(margin="combined", m1=0.9), _margin("Combined", m1=0.9)),
    "m2": Reaches(dict(margin="combined", m2=0.3), _margin("Combined", m2=0.3)),
    "m3": Reaches(dict(margin="combined", m3=0.1), _margin("Combined", m3=0.1)),
    "easy_margin": Reaches(dict(easy_margin=True), _margin("ArcFace", easy_margin=True)),
    "sphereface_lambda": Reaches(dict(margin="sphereface", sphereface_lambda=5.0), _margin("SphereFace", lambda_=5.0)),
    "adaface_h": Reaches(dict(margin="adaface", adaface_h=0.5), _margin("AdaFace", h=0.5)),
    "adaface_momentum": Reaches(dict(margin="adaface", adaface_momentum=0.1), _margin("AdaFace", momentum=0.1)),
    "magface_l_a": Reaches(dict(margin="magface", magface_l_a=20.0), _margin("MagFace", l_a=20.0)),
    "magface_u_a": Reaches(dict(margin="magface", magface_u_a=100.0), _margin("MagFace", u_a=100.0)),
    "magface_l_m": Reaches(dict(margin="magface", magface_l_m=0.4), _margin("MagFace", l_m=0.4)),
    "magface_u_m": Reaches(dict(margin="magface", magface_u_m=0.7), _margin("MagFace", u_m=0.7)),
    "magface_lambda_g": Reaches(dict(margin="magface", magface_lambda_g=30.0), _margin("MagFace", lambda_g=30.0)),
    "subcenters": Reaches(dict(subcenters=3), _head(subcenters=3)),
    "interclass_filter_threshold": Reaches(dict(interclass_filter_threshold=0.5), _head(interclass_filter_threshold=0.5)),
    "sample_rate": Reaches(dict(sample_rate=0.5), _head(sample_rate=0.5)),
    "chunk_size": Reaches(dict(chunk_size=4), _head(chunk_size=4)),
    "head_impl": Reaches(dict(head_impl="torch"), _head(impl="torch")),
    "label_smoothing": Reaches(dict(label_smoothing=0.1), _head(label_smoothing=0.1)),
    "head_dtype": Reaches(dict(head_dtype="bfloat16"), _head(dtype="torch.bfloat16")),
    "head_rounding": Reaches(dict(head_dtype="bfloat16", head_rounding="stochastic"),
                             _groups(("opt_head",), rounding="stochastic")),
    "sparse_grad": Reaches(dict(sample_rate=0.5, sparse_grad=True), _head(sparse_grad=True)),
    "head_idle_rows": Reaches(dict(sample_rate=0.5, head_idle_rows="lazy"),
                              lambda s, b: s["opt_head"]["idle_rows"] == "lazy"),
    "triplet_weight": Reaches(dict(triplet_weight=1.0), lambda s, b: s["triplet"] == (0.3, False),
                              refused={"pipeline": f"triplet_weight=1.0 {NO_TRIPLET}"}),
    "triplet_margin": Reaches(dict(triplet_weight=1.0, triplet_margin=0.5), lambda s, b: s["triplet"] == (0.5, False),
                              refused={"pipeline": f"triplet_margin=0.5 {NO_TRIPLET}"}),
    "triplet_soft": Reaches(dict(triplet_weight=1.0, triplet_soft=True), lambda s, b: s["triplet"] == (0.3, True),
                            refused={"pipeline": f"triplet_soft=True {NO_TRIPLET}"}),
    # ---- optim
    "optimizer": Reaches(dict(optimizer="adamw"),
                         lambda s, b: s["opt_backbone"]["type"] == "AdamW" and s["opt_head"]["type"] == "AdamW"),
    "lr": Reaches(dict(lr=0.2), _groups(BOTH, initial_lr=0.2)),
    "momentum": Reaches(dict(momentum=0.5), _groups(BOTH, momentum=0.5)),
    "head_momentum": Reaches(dict(head_momentum=0.0),
                             lambda s, b: s["opt_head"]["group"].get("momentum") == 0.0
                             and s["opt_backbone"]["group"].get("momentum") == 0.9),
    "weight_decay": Reaches(dict(weight_decay=1e-3), _groups(BOTH, weight_decay=1e-3)),
    "nesterov": Reaches(dict(nesterov=True), _groups(BOTH, nesterov=True)),
    "betas": Reaches(dict(optimizer="adamw", betas=[0.8, 0.9]), _groups(BOTH, betas=(0.8, 0.9))),
    "eps": Reaches(dict(optimizer="adamw", eps=1e-6), _groups(BOTH, eps=1e-6)),
    "grad_clip": Other("step"),
    "head_grad_clip": Other("step"),
    # the factory decides who applies the head's step: 'fused' on the CPU is its error (one micro-batch
    # per pipeline step: more is refused by validate, test_head_update.py)
    "head_update": Reaches(dict(head_update="fused", micro_batches=1, pipeline_schedule="gpipe"),
                           lambda s, b: s.get("error", "").startswith("head_update='fused': the run is on the CPU")),
    "grad_accum": Other("step"),
    # the captured head step: on the CPU the builder's error (CUDA tests: tests/head/fused/test_capture.py);
    # one head in one process only, so every other strategy refuses it
    "cuda_graph": Reaches(dict(cuda_graph="head", nproc=1),
                          lambda s, b: s.get("error", "").startswith("cuda_graph='head': the run is on cpu"),
                          refused={st: "cuda_graph='head' is not supported by" for st in ("dp", "horovod", "pipeline")}),
    # ---- schedule
    "batch_size": Reaches(dict(batch_size=16), lambda s, b: s["plan"]["local_batch"] == 16, **{**PIPE_ONLY, "elsewhere": "data"}),
    "max_steps": Other("length"), "epochs": Other("length"),
    "scheduler": Reaches(dict(scheduler="cosine"), lambda s, b: s["schedule"] != b["schedule"]),
    "poly_power": Reaches(dict(poly_power=1.0), lambda s, b: s["schedule"] != b["schedule"]),
    "warmup_steps": Reaches(dict(warmup_steps=4), lambda s, b: s["schedule"][0][0] == pytest.approx(0.2)),
    # ---- run
    "strategy": Other("layout"),
    "pipeline_stages": Other("layout"),  # the layout's (tests/train/builder/test_pipeline_four_stages.py: 4 stages)
    "pipeline_schedule": Reaches(dict(pipeline_schedule="gpipe"), lambda s, b: s["plan"]["schedule"] == "ScheduleGPipe",
                                 **PIPE_ONLY),
    "micro_batches": Reaches(dict(micro_batches=4), lambda s, b: s["plan"]["micro_batches"] == 4, **PIPE_ONLY),
    "split_points": Reaches(dict(backbone="mobilefacenet", image_size=[], split_points=["stem"]),
                            lambda s, b: s["plan"]["split_points"] == ("stem",), **PIPE_ONLY),
    "micro_batch_stats": Reaches(dict(micro_batch_stats=False, micro_batches=1, pipeline_schedule="gpipe"),
                                 lambda s, b: s["plan"]["micro_batch_stats"] is False, **PIPE_ONLY),
    "amp": Other("precision"),
    "channels_last": Reaches(dict(channels_last=False), lambda s, b: not s["channels_last"],
                             only=("ddp", "dp", "pipeline"), elsewhere="contiguous"),
    "compile": Reaches(dict(compile=True), lambda s, b: s["compiled"],
                       refused={"dp": "compile=True is not supported by strategy='dp'"}),
    "seed": Reaches(dict(seed=3), lambda s, b: s["head"]["init_seed"] == 3 and s["head"]["sample_seed"] == 3
                    and s["backbone_sum"] != b["backbone_sum"]),
    "nproc": Other("launch"), "device": Other("launch"), "threads": Other("launch"), "pg_timeout": Other("launch"),
    "output_dir": Other("checkpoint"), "resume": Other("checkpoint"), "ckpt_every": Other("checkpoint"),
    "keep_last": Other("checkpoint"), "save_on_signal": Other("checkpoint"), "trust_checkpoint": Other("checkpoint"),
    "log_every": Other("logging"), "progress": Other("logging"), "profile": Other("logging"),
    # ---- eval
    "eval_every": Other("eval"), "val_bins": Other("eval"), "reid_root": Other("eval"),
    "synthetic_val_pairs": Other("eval"), "eval_batch_size": Other("eval"), "eval_flip": Other("eval"),
    # ---- classes
    "init_from": Other("classes"),
    "head_init": Other("classes", refused={"pipeline": ("imprint", "strategy='pipeline' cuts the backbone into "
                                                                   "stages: head_init='imprint' needs")}),
    "head_warmup_steps": Other("step"),
    "backbone_lr_mult": Reaches(dict(backbone_lr_mult=0.1), lambda s, b: s["opt_backbone"]["group"]["initial_lr"]
                                == pytest.approx(0.01) and s["opt_head"]["group"]["initial_lr"] == 0.1),
    "on_missing_classes": Other("classes"), "rename_classes": Other("classes"),
}


def config(strategy: str, **changes) -> TrainConfig:
    """The base config of every probe under ``strategy``, with ``changes``."""
    base = TrainConfig(
        synthetic_identities=12, image_size=[16, 16], embedding_dim=16, batch_size=8, max_steps=10, warmup_steps=2,
        lr=0.1, nproc=2, strategy=strategy, micro_batches=2, micro_batch_stats=True, progress=False,
        output_dir="unused",
    )
    return dataclasses.replace(base, **changes)


def probes(strategy: str) -> Dict[str, Dict[str, Any]]:
    """``{field: probe}`` of the fields that reach the parts under ``strategy`` (and ``"": {}``, the base)."""
    out: Dict[str, Dict[str, Any]] = {"": {}}
    for name, entry in TABLE.items():
        if isinstance(entry, Reaches) and strategy in entry.only and strategy not in entry.refused:
            out[name] = entry.probe
    return out


# ---------------------------------------------------------------------------- building and summarising


def _channels_last_anywhere(cfg: TrainConfig, device, backbone: nn.Module) -> bool:
    """``use_channels_last`` as on CUDA, on any device (the CPU runs channels_last convolutions too)."""
    from shardfc.train.builder.factory import channels_last_wanted

    return channels_last_wanted(cfg, backbone)


def _scalars(obj) -> Dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if isinstance(v, (bool, int, float, str))}


def _optimizer(opt: Optional[torch.optim.Optimizer]) -> Optional[dict]:
    if opt is None:
        return None
    group = {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in opt.param_groups[0].items()
             if k != "params" and isinstance(v, (bool, int, float, str, list, tuple))}
    base = next(c for c in type(opt).__mro__ if c.__module__.startswith(("torch.optim", "shardfc")))
    return {"type": base.__name__, "group": group, "fused_update": getattr(opt, "fused_update", False),
            "idle_rows": getattr(opt, "idle_rows", None)}


def summarize(parts, plan) -> dict:
    """What the built parts say about the config they came from (plain values, sent between processes)."""
    module = parts.module
    head = parts.head
    s: Dict[str, Any] = {
        "keys": tuple(plan.state_keys) if plan is not None else tuple(module.state_dict()),
        "input_size": tuple(plan.specs[0][0][1:]) if plan is not None else tuple(module.input_size)
        if hasattr(module, "input_size") else None,
        "embedding": plan.specs[-1][0][0] if plan is not None else getattr(module, "embedding_dim", None),
        "backbone_sum": float(sum(p.detach().double().sum() for p in module.parameters())),
        "channels_last": any(p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                             for p in module.parameters()),
        "compiled": getattr(module, "_compiled_call_impl", None) is not None,
        "opt_backbone": _optimizer(parts.opt_backbone),
        "opt_head": _optimizer(parts.opt_head),
        "schedule": [[round(sch.lr_lambdas[0](t), 6) for t in range(10)] for sch in parts.schedulers],
        "scaler": parts.scaler.is_enabled(),
        "triplet": None if parts.triplet is None else (parts.triplet.margin, parts.triplet.soft),
        "head": None,
        "plan": None,
    }
    if head is not None:
        s["head"] = {
            "margin": type(head.margin).__name__, "margin_attrs": _scalars(head.margin),
            "dtype": str(next(head.parameters()).dtype), "mode": head.mode,
            **{k: getattr(head, k) for k in ("embedding_dim", "num_classes", "label_smoothing", "chunk_size",
                                             "sample_rate", "sample_seed", "sparse_grad", "init_seed", "subcenters",
                                             "interclass_filter_threshold", "impl")},
        }
    if plan is not None:
        runner = plan.runner
        s["plan"] = {"schedule": type(runner.schedule).__name__, "micro_batches": runner.micro_batches,
                     "local_batch": runner.local_batch, "micro_batch_stats": runner.allow_micro_batch_stats,
                     "split_points": tuple(plan.split_points), "stage": plan.layout.stage}
    return s


def build_summary(cfg: TrainConfig, ctx: DistContext, layout=None) -> dict:
    """Build ``cfg``'s parts as ``build_run`` does (without a dataset) and summarise them; ``{"error": ...}``
    when the build refuses the config."""
    from shardfc.train.builder.factory import build_model, resolve_amp_dtype, resolve_image_size

    try:
        cfg = cfg.validate()
        parts, plan = build_model(cfg, ctx, cfg.synthetic_identities, resolve_image_size(cfg), cfg.max_steps,
                                  resolve_amp_dtype(cfg, ctx.device), layout)
    except ConfigError as e:
        return {"error": str(e)}
    return summarize(parts, plan)


def merge_stages(per_rank: List[dict]) -> dict:
    """One summary of a pipeline's stages (rank 0: the first, rank 1: the last, with the head)."""
    if any("error" in s for s in per_rank):
        return next(s for s in per_rank if "error" in s)
    first, last = per_rank
    assert first["opt_backbone"] == last["opt_backbone"] and first["schedule"][0] == last["schedule"][0]
    assert first["head"] is None and first["keys"] == last["keys"]
    return {**last, "channels_last": first["channels_last"] or last["channels_last"],
            "compiled": first["compiled"] and last["compiled"], "backbone_sum": first["backbone_sum"] + last["backbone_sum"]}


@contextlib.contextmanager
def _stages_in(dtype: torch.dtype):
    """``build_model`` with the stage, what crosses the stages and the head in ``dtype`` (float64: the
    reference the float32 steps are held to)."""
    import shardfc.train.builder.factory as build
    import shardfc.train.builder.pipeline_train as pipeline_train

    specs, head = pipeline_train.chained_activation_specs, build.build_head
    if dtype != torch.float32:
        def specs_in(module, layout, input_spec, *args):
            return specs(module.to(dtype), layout, (input_spec[0], dtype), *args)

        pipeline_train.chained_activation_specs = specs_in
        build.build_head = lambda *args: head(*args).to(dtype)
    try:
        yield
    finally:
        pipeline_train.chained_activation_specs, build.build_head = specs, head


def _world_worker(rank: int, world: int, ddp_probes: dict, pipe_probes: dict) -> dict:
    """Every probe built under ddp (DDP over the 2 ranks) and pipeline (2 stages, one layout), and one
    pipeline step of a channels_last stage and of the contiguous one."""
    import shardfc.train.builder.factory as build
    from shardfc.train.builder.pipeline_train import pipeline_layout

    build.use_channels_last = _channels_last_anywhere
    ctx = DistContext.resolve()
    layout = pipeline_layout(config("pipeline").validate(), ctx)
    out = {
        "ddp": {name: build_summary(config("ddp", **p), ctx) for name, p in ddp_probes.items()},
        "pipeline": {name: build_summary(config("pipeline", **p), ctx, layout) for name, p in pipe_probes.items()},
    }
    losses = []
    for channels_last, dtype in ((True, torch.float32), (False, torch.float32), (False, torch.float64)):
        with _stages_in(dtype):
            parts, plan = build.build_model(config("pipeline", channels_last=channels_last).validate(), ctx, 12,
                                            (16, 16), 10, None, layout)
        gen = torch.Generator().manual_seed(0)
        images, labels = torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 12, (8,), generator=gen)
        loss = plan.runner.step(images.to(dtype) if layout.is_first else None, labels if layout.is_last else None)
        grad = [p.grad.clone() for p in parts.module.parameters() if p.grad is not None]
        assert all(g.dtype == dtype for g in grad)
        losses.append((None if loss is None else float(loss), grad))
    out["channels_last_steps"] = losses
    # --compile: each stage is compiled where it runs (the eager backend here: what is tested is that
    # dynamo traces the stage at all, which it did not for a plain nn.Sequential stage)
    from torch._dynamo.utils import counters

    real = nn.Module.compile
    nn.Module.compile = lambda self, *a, **k: real(self, *a, **{**k, "backend": "eager"})
    parts, plan = build.build_model(config("pipeline", compile=True).validate(), ctx, 12, (16, 16), 10, None, layout)
    counters.clear()
    plan.runner.step(images if layout.is_first else None, labels if layout.is_last else None)
    out["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return out


@pytest.fixture(scope="module")
def ddp_and_pipeline() -> dict:
    ranks = spawn(_world_worker, 2, probes("ddp"), probes("pipeline"), backend="gloo", timeout_s=300)
    summaries = {
        "ddp": ranks[0]["ddp"],
        "pipeline": {name: merge_stages([r["pipeline"][name] for r in ranks]) for name in ranks[0]["pipeline"]},
    }
    return {"summaries": summaries, "channels_last_steps": [r["channels_last_steps"] for r in ranks],
            "compiled_graphs": [r["compiled_graphs"] for r in ranks]}


def _horovod_worker(horovod_probes: dict) -> dict:
    import shardfc.train.builder.factory as build
    from shardfc.train.builder.factory import run_context

    build.use_channels_last = _channels_last_anywhere
    ctx = run_context(config("horovod", device="cpu"), None)  # hvd.init(): a world of one outside horovodrun
    return {name: build_summary(config("horovod", **p), ctx) for name, p in horovod_probes.items()}


def _summaries(strategy: str, request, monkeypatch) -> dict:
    if strategy in ("ddp", "pipeline"):
        return request.getfixturevalue("ddp_and_pipeline")["summaries"][strategy]
    if strategy == "dp":
        import shardfc.train.builder.factory as build
        import shardfc.train.builder.strategy as strategy_module
        from shardfc.train.builder.factory import run_context

        if torch.cuda.device_count() < 2:  # the strategy itself: refused here, saying why
            with pytest.raises(ConfigError, match=r"strategy='dp' replicates the backbone over CUDA devices"):
                run_context(config("dp"), None)
        # its code path: the backbone in a (pass-through) DataParallel, the head over two CPU "devices"
        monkeypatch.setattr(strategy_module, "_dp_device_list", lambda cfg: [torch.device("cpu")] * 2)
        monkeypatch.setattr(build, "use_channels_last", _channels_last_anywhere)
        ctx = run_context(config("dp"), None)
        return {name: build_summary(config("dp", **p), ctx) for name, p in probes("dp").items()}
    request.getfixturevalue("horovodrun")  # skipped without Horovod (a failure with SHARDFC_REQUIRE_HOROVOD=1)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_horovod_worker, probes("horovod")).result(timeout=300)


# ---------------------------------------------------------------------------- the tests


def test_every_field_is_classified():
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    missing, unknown = sorted(set(names) - set(TABLE)), sorted(set(TABLE) - set(names))
    assert not missing, f"TrainConfig fields without an entry in test_builder.TABLE (reaches / refused / other): {missing}"
    assert not unknown, f"TABLE names fields TrainConfig does not have: {unknown}"
    for name, entry in TABLE.items():
        if isinstance(entry, Other):
            assert entry.category in CATEGORIES, (name, entry.category)
        else:
            assert set(entry.only) <= set(STRATEGIES) and set(entry.refused) <= set(STRATEGIES), name
            assert entry.only == STRATEGIES or entry.elsewhere in CATEGORIES, name
            assert name in entry.probe, f"{name}'s probe does not set it"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_refused_field_is_a_one_line_error_naming_it(strategy):
    refused = 0
    for name, entry in TABLE.items():
        if strategy not in entry.refused:
            continue
        value, start = (entry.probe[name], entry.refused[strategy]) if isinstance(entry, Reaches) \
            else entry.refused[strategy]
        with pytest.raises(ConfigError) as err:
            config(strategy, **{name: value}).validate()
        msg = str(err.value)
        assert msg.startswith(start), (name, msg)
        assert "\n" not in msg and f"{name}={value!r}" in msg and f"strategy={strategy!r}" in msg, (name, msg)
        refused += 1
    assert refused == {"pipeline": 5, "dp": 2, "horovod": 1}.get(strategy, 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_build_field_reaches_the_parts(strategy, request, monkeypatch):
    summaries = _summaries(strategy, request, monkeypatch)
    base = summaries[""]
    assert "error" not in base, base
    unreached = []
    for name, entry in TABLE.items():
        if not isinstance(entry, Reaches) or strategy not in entry.only or strategy in entry.refused:
            continue
        got = summaries[name]
        if "error" in got and not (entry.probe.get("head_update") or entry.probe.get("cuda_graph")):
            unreached.append(f"{name}: the build refused {entry.probe}: {got['error']}")
        elif entry.check(base, base):
            unreached.append(f"{name}: its check holds for the base config too (it tells nothing)")
        elif not entry.check(got, base):
            unreached.append(f"{name}={entry.probe[name]!r} did not reach the {strategy} parts")
    assert not unreached, "\n".join(unreached)
    assert base["head"]["mode"] == {"dp": "devices"}.get(strategy, "group"), base["head"]


def test_a_channels_last_stage_trains_as_the_contiguous_one(ddp_and_pipeline):
    """A stage in channels_last converts its own input and hands on a contiguous output, so the
    pipeline's checks of what crosses the stages pass, with the contiguous stage's loss and gradients."""
    first, last = ddp_and_pipeline["channels_last_steps"]
    assert first[0][0] is None and last[0][0] is not None
    # Both float32 steps are held to the float64 one, not to each other at a tolerance fitted to one CPU:
    # channels_last takes other kernels (other oneDNN ones on AVX2 than on AVX-512), so other rounding.
    # What float32 guarantees: a sum of n terms is within n·u of the exact sum, relative to its terms
    # (u: the unit roundoff); the longest sum of this step is a convolution's weight gradient over a
    # micro-batch, 4 rows × 16 × 16 pixels. Held normwise per tensor (an element that cancels to near
    # zero keeps its terms' error, not its own size's); measured: 1e-6–3e-6 on AVX-512 and AVX2 alike,
    # while a stage fed or handing on the wrong layout is off by O(1).
    bound = 4 * 16 * 16 * torch.finfo(torch.float32).eps / 2
    for loss, _ in last[:2]:
        assert loss == pytest.approx(last[2][0], rel=bound)
    for rank in (first, last):
        (_, a), (_, b), (_, ref) = rank
        assert len(a) == len(b) == len(ref) > 0
        for x, y, r in zip(a, b, ref):
            assert x.dtype == y.dtype == torch.float32 and r.dtype == torch.float64
            for g in (x, y):
                assert (g.double() - r).norm() <= bound * r.norm(), ((g.double() - r).norm() / r.norm(), bound)


def test_a_compiled_stage_is_traced(ddp_and_pipeline):
    """``--compile`` under pipeline compiles each rank's stage where the schedule runs it."""
    assert all(n >= 1 for n in ddp_and_pipeline["compiled_graphs"]), ddp_and_pipeline["compiled_graphs"]
