"""The factory's own decisions, in this process (a world of one): what ``build_run`` hands on and in
which order it says so, its errors in full, and the small helpers. The spawned tests of
``test_builder.py`` hold every field under every strategy; mutation testing sees only the test's
own process, so the wiring around ``build_model`` is held here too."""

from __future__ import annotations

import dataclasses
import logging
import math
from types import SimpleNamespace

import pytest
import torch

import shardfc.train.builder.factory as factory
from shardfc.parallel.context import DistContext
from shardfc.train.builder import cpu
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.schedule import WarmupDecay

CPU = torch.device("cpu")


def small(**changes) -> TrainConfig:
    cfg = TrainConfig(synthetic_identities=12, synthetic_images_per_identity=3, image_size=[16, 16], embedding_dim=8,
                      batch_size=4, max_steps=5, warmup_steps=1, lr=0.1, nproc=1, progress=False, output_dir="unused")
    return dataclasses.replace(cfg, **changes)


class Clock:
    def __init__(self):
        self.marks = []

    def mark(self, name):
        self.marks.append(name)


@pytest.fixture
def spies(monkeypatch):
    """``build_model`` and ``rank_batches`` run as they are, their arguments recorded."""
    seen = {}
    real_model, real_batches = factory.build_model, factory.rank_batches

    def build_model(*args):
        seen["build_model"] = args
        return real_model(*args)

    def rank_batches(cfg, dataset, batch_size, ctx, drop_last=None):
        seen["rank_batches"] = (batch_size, ctx, drop_last)
        return real_batches(cfg, dataset, batch_size, ctx, drop_last=drop_last)

    monkeypatch.setattr(factory, "build_model", build_model)
    monkeypatch.setattr(factory, "rank_batches", rank_batches)
    return seen


def test_a_run_is_built_from_its_config_and_says_each_phase(spies, monkeypatch):
    monkeypatch.setattr(cpu, "bf16_support", lambda: (True, "flags avx512_bf16"))
    channels_last = []

    def use_channels_last(cfg, device, module):  # as CUDA would say, asked of the run's own parts
        channels_last.append((cfg.channels_last, device, module))
        return True

    monkeypatch.setattr(factory, "use_channels_last", use_channels_last)
    cfg, ctx, clock = small(amp="bf16", max_steps=0, epochs=3, grad_accum=2, drop_last=False), DistContext(), Clock()
    run = factory.build_run(cfg, ctx, clock)
    assert clock.marks == ["dataset", "sampler", "model, head and optimizers"]
    # 36 images in batches of 4: 9 a pass, 3 passes, 2 micro-batches a step
    assert len(run.batches) == 9 and run.total_steps == math.ceil(3 * 9 / 2) == 14
    assert spies["rank_batches"] == (4, ctx, False)
    assert spies["build_model"][2:] == (12, (16, 16), 14, torch.bfloat16, None)
    assert run.amp_dtype is torch.bfloat16 and run.pipeline is None and run.classes is None
    # asked by prepare_backbone, then of the built module for the batches
    assert channels_last[-1] == (True, CPU, run.parts.module) and run.channels_last is True
    assert run.num_classes == 12 and run.data_ctx is ctx
    assert spies["rank_batches"][2] is False
    run = factory.build_run(dataclasses.replace(cfg, drop_last=True), ctx)  # no clock: nothing to mark
    assert spies["rank_batches"][2] is True


def test_a_pipeline_run_hands_its_layout_on(spies, monkeypatch):
    """Under pipeline: the layout's replicas are the data's ranks, partial batches are dropped, the
    stage is built with the layout, and its batches stay NCHW (the stage converts its own input)."""
    replicas = DistContext()
    layout = SimpleNamespace(replica_ctx=replicas)
    asked = []
    monkeypatch.setattr(factory, "pipeline_layout", lambda cfg, ctx: asked.append((cfg, ctx)) or layout)
    monkeypatch.setattr(factory, "use_channels_last", lambda cfg, device, module: True)

    def build_model(*args):
        spies["build_model"] = args
        return SimpleNamespace(module=torch.nn.Linear(1, 1)), "the plan"

    monkeypatch.setattr(factory, "build_model", build_model)
    cfg, ctx, clock = small(strategy="pipeline", pipeline_stages=2), DistContext(), Clock()
    run = factory.build_run(cfg, ctx, clock)
    assert asked == [(cfg, ctx)]
    assert clock.marks == ["dataset", "sampler", "pipeline stage, head and optimizers"]
    assert spies["rank_batches"][1] is replicas and spies["rank_batches"][2] is True
    assert spies["build_model"] == (cfg, ctx, 12, (16, 16), 5, None, layout)
    assert run.pipeline == "the plan" and run.channels_last is False


@pytest.mark.parametrize("strategy, ranks, words", [
    ("ddp", 13, "for 13 ranks: every rank must hold at least one class of the head; use --nproc 12 or fewer"),
    ("pipeline", 13, "for 13 ranks (the last pipeline stage's): every rank must hold at least one class of the head; "
                     "use --nproc 36 or fewer"),
])
def test_fewer_classes_than_head_ranks_is_refused_saying_how_many_ranks(monkeypatch, strategy, ranks, words):
    ranks_ctx = SimpleNamespace(world_size=ranks, device=CPU, is_main=True)
    monkeypatch.setattr(factory, "pipeline_layout", lambda cfg, ctx: SimpleNamespace(replica_ctx=ranks_ctx))
    with pytest.raises(ConfigError) as err:
        factory.build_run(small(strategy=strategy, pipeline_stages=3), ranks_ctx)
    assert str(err.value) == f"the dataset has 12 class(es) {words}"


def test_as_many_classes_as_ranks_is_enough(monkeypatch):
    monkeypatch.setattr(factory, "build_model", lambda *args: (SimpleNamespace(module=None), None))
    monkeypatch.setattr(factory, "rank_batches", lambda *args, **kwargs: [])
    ctx = SimpleNamespace(world_size=12, device=CPU, is_main=True)
    assert factory.build_run(small(), ctx).num_classes == 12


def test_the_classes_a_checkpoint_decides_reach_the_run(monkeypatch):
    planned = []

    def plan_run_classes(cfg, dataset, checkpoint, init_from):
        planned.append((cfg, checkpoint, init_from))
        assert dataset.num_classes == 12
        # the head's rows now: one more than the data's identities
        return factory.train_dataset(dataclasses.replace(cfg, synthetic_identities=13), (16, 16)), "the class plan"

    monkeypatch.setattr(factory, "plan_run_classes", plan_run_classes)
    cfg = small()
    run = factory.build_run(cfg, DistContext(), classes_from=("ckpt", True))
    assert planned == [(cfg, "ckpt", True)]
    assert run.classes == "the class plan" and run.num_classes == 13 and run.parts.head.num_classes == 13


@pytest.mark.parametrize("changes, main, warned", [
    (dict(triplet_weight=1.0), True, True),
    (dict(triplet_weight=0.5), True, True),
    (dict(triplet_weight=1.0, sampler="pk", pk_instances=2), True, False),
    (dict(triplet_weight=1.0), False, False),
    (dict(), True, False),
])
def test_a_triplet_loss_without_pk_batches_is_warned_about_once(monkeypatch, caplog, changes, main, warned):
    monkeypatch.setattr(factory, "build_model", lambda *args: (SimpleNamespace(module=None), None))
    ctx = SimpleNamespace(world_size=1, device=CPU, is_main=main, rank=0)
    monkeypatch.setattr(factory, "rank_batches", lambda *args, **kwargs: [])
    with caplog.at_level(logging.WARNING, logger="shardfc.train"):
        factory.build_run(small(**changes), ctx)
    expected = ["triplet_weight > 0 with sampler='random': few batches hold two images of one identity; "
                "use --sampler pk"]
    assert caplog.messages == (expected if warned else [])


def test_build_parts_is_build_model_for_a_whole_backbone():
    cfg = small(scheduler="poly")
    parts = factory.build_parts(cfg, DistContext(), 12, (16, 16), total_steps=7, amp_dtype=torch.float16)
    assert parts.scaler.is_enabled()  # fp16's loss scaling
    schedule = WarmupDecay(cfg, 7)
    assert [parts.schedulers[0].lr_lambdas[0](t) for t in range(9)] == [schedule(t) for t in range(9)]
    assert not factory.build_parts(cfg, DistContext(), 12, (16, 16), 7, None).scaler.is_enabled()


def test_channels_last_is_never_wanted_under_horovod():
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    assert factory.channels_last_wanted(small(channels_last=True), conv)
    assert not factory.channels_last_wanted(small(channels_last=True, strategy="horovod"), conv)
    assert not factory.channels_last_wanted(small(channels_last=True), torch.nn.Linear(2, 2))


def test_a_stage_runs_under_the_runs_autocast():
    with factory.autocast_factory(CPU, None)():
        assert not torch.is_autocast_enabled("cpu")
    for dtype in (torch.bfloat16, torch.float16):  # fp16: not the CPU's default autocast dtype
        with factory.autocast_factory(CPU, dtype)():
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
    assert not torch.is_autocast_enabled("cpu")


CUDA = torch.device("cuda")  # only its type is read: no GPU needed


@pytest.mark.parametrize("amp, device, bf16, changes, dtype, said", [
    ("auto", CPU, True, {}, None, None),
    ("auto", CUDA, True, {}, torch.bfloat16, None),
    ("auto", CUDA, False, {}, torch.float16, None),
    ("auto", CUDA, False, dict(sample_rate=0.5, sparse_grad=True), None,
     "amp='auto' on a GPU without bf16, with sparse_grad (fp16's loss scaler cannot unscale it): fp32"),
    ("none", CUDA, True, {}, None, None),
    ("bf16", CUDA, True, {}, torch.bfloat16, None),
    ("bf16", CUDA, False, {}, torch.float16,
     "amp='bf16' asked for, but this GPU lacks bf16: using fp16 autocast with loss scaling instead"),
    ("fp16", CUDA, True, {}, torch.float16, None),
    ("fp16", CUDA, False, {}, torch.float16, None),
])
def test_the_autocast_dtype_on_a_gpu(monkeypatch, caplog, amp, device, bf16, changes, dtype, said):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(cpu, "bf16_support", lambda: pytest.fail("the CPU's bf16 asked on a GPU"))
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert factory.resolve_amp_dtype(small(amp=amp, **changes), device) is dtype
    assert caplog.messages == ([said] if said else [])


@pytest.mark.parametrize("amp, native, dtype, said", [
    ("fp16", False, None,
     "amp='fp16' asked for, but this run is on the CPU, where fp16 autocast is slow and covers few ops, and this CPU "
     "has no native bf16 (what was found), so bf16 autocast would be slower than fp32 too: training in fp32, the "
     "faster of the two"),
    ("fp16", True, torch.bfloat16,
     "amp='fp16' asked for, but this run is on the CPU, where fp16 autocast is slow and covers few ops: using bf16 "
     "autocast instead (fp32's range, so no loss scaling)"),
    ("bf16", False, torch.bfloat16,
     "amp='bf16' on a CPU without native bf16 (what was found): every bf16 op is converted through fp32 in software, "
     "so steps are slower than in fp32, not faster; pass --amp none unless you want bf16's numerics"),
    ("bf16", True, torch.bfloat16, None),
    ("bf16", None, torch.bfloat16, None),
])
def test_the_autocast_dtype_on_the_cpu_said_in_full(monkeypatch, caplog, amp, native, dtype, said):
    monkeypatch.setattr(cpu, "bf16_support", lambda: (native, "what was found"))
    with caplog.at_level(logging.INFO, logger="shardfc.train"):
        assert factory.resolve_amp_dtype(small(amp=amp), CPU) is dtype
    assert caplog.messages == ([said] if said else [])


@pytest.mark.parametrize("is_last", [False, True], ids=["first stage", "last stage"])
def test_a_pipeline_stage_is_cut_prepared_and_planned_as_the_layout_says(monkeypatch, is_last):
    """``build_model`` with a layout, its collectives stood in for: the stage is cut from the builder's
    own backbone under the run's autocast, prepared as a stage, holds the head on the last stage only,
    and the plan is made of what was built."""
    ctx = DistContext()
    layout = SimpleNamespace(is_last=is_last, replica_ctx=ctx)
    stage = SimpleNamespace(module=torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)))
    cut, prepared = [], []

    def cut_stage(cfg, ctx_, layout_, new_backbone, image_size, autocast):
        backbone = new_backbone()
        with autocast():
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        cut.append((cfg, ctx_, layout_, backbone.embedding_dim, image_size, dtype))
        return stage

    real_prepare = factory.prepare_backbone

    def prepare_backbone(cfg, device, module, pipeline_stage=False):
        prepared.append((cfg, device, module, pipeline_stage))
        return real_prepare(cfg, device, module, pipeline_stage)

    monkeypatch.setattr(factory, "cut_stage", cut_stage)
    monkeypatch.setattr(factory, "prepare_backbone", prepare_backbone)
    monkeypatch.setattr(factory, "pipeline_plan", lambda *args: args)
    cfg = small(strategy="pipeline", pipeline_stages=2, head_grad_clip=1.0)
    parts, plan = factory.build_model(cfg, ctx, 12, (16, 16), 5, torch.bfloat16, layout)
    assert cut == [(cfg, ctx, layout, 8, (16, 16), torch.bfloat16)]
    assert prepared == [(cfg, CPU, stage.module, True)]
    assert parts.module is stage.module
    assert plan == (cfg, ctx, layout, stage, parts)
    params = {id(p) for g in parts.opt_backbone.param_groups for p in g["params"]}
    assert params == {id(p) for p in stage.module.parameters()}
    if is_last:
        assert parts.head is not None and parts.head.ctx is ctx and parts.head._grad_sq_on  # head_grad_clip's norm
        assert len(parts.schedulers) == 2
    else:
        assert parts.head is None and parts.opt_head is None and len(parts.schedulers) == 1


def test_a_whole_backbone_is_moved_to_the_device_and_the_head_placed_by_the_strategy(monkeypatch):
    moved, placed = [], []
    real_backbone, real_placement = factory.build_backbone, factory.head_placement

    def build_backbone(*args, **kwargs):
        module = real_backbone(*args, **kwargs)
        to = module.to
        module.to = lambda *a, **k: moved.append(a) or to(*a, **k)
        return module

    monkeypatch.setattr(factory, "build_backbone", build_backbone)
    monkeypatch.setattr(factory, "head_placement", lambda cfg, ctx: placed.append(ctx) or real_placement(cfg, ctx))
    ctx = DistContext()
    parts = factory.build_parts(small(), ctx, 12, (16, 16), 5, None)
    assert moved == [(CPU,)] and placed == [ctx] and parts.head.ctx is ctx
    assert not parts.head._grad_sq_on  # no head_grad_clip: the norm is not measured
    assert factory.build_parts(small(head_grad_clip=1.0), ctx, 12, (16, 16), 5, None).head._grad_sq_on


def test_channels_last_is_used_on_cuda_only():
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    assert factory.use_channels_last(small(channels_last=True), CUDA, conv)
    assert factory.use_channels_last(small(channels_last=True), "cuda:1", conv)
    assert not factory.use_channels_last(small(channels_last=True), CPU, conv)
    assert not factory.use_channels_last(small(channels_last=False), CUDA, conv)
    assert not factory.use_channels_last(small(channels_last=True), CUDA, torch.nn.Linear(2, 2))


def test_the_image_size_is_the_configs_or_the_backbones(monkeypatch):
    assert factory.resolve_image_size(small(image_size=[])) == (32, 32)  # tiny's
    assert factory.resolve_image_size(small(image_size=[20, 24])) == (20, 24)
    assert factory.resolve_image_size(small(backbone="mobilefacenet", image_size=[112, 112])) == (112, 112)
    with pytest.raises(ConfigError) as err:
        factory.resolve_image_size(small(backbone="mobilefacenet", image_size=[20, 24]))
    assert str(err.value) == ("image_size=[20, 24] but backbone='mobilefacenet' takes 112x112 inputs "
                              "(only tiny, resnet50 accept other sizes)")


def test_the_run_context_is_the_strategys_for_the_group(monkeypatch):
    monkeypatch.setattr(factory, "strategy_context", lambda cfg, group: (cfg, group))
    cfg = small()
    assert factory.run_context(cfg, "group") == (cfg, "group")


def test_a_ranks_seed_depends_on_the_seed_the_rank_and_the_step():
    seeds = {factory.rank_seed(s, r, t) for s, r, t in [(1, 2, 3), (5, 2, 3), (1, 4, 3), (1, 2, 7)]}
    assert len(seeds) == 4
    assert factory.rank_seed(1, 2, 3) == factory.rank_seed(1, 2, 3)


def test_every_part_of_a_whole_backbone_run_gets_the_runs_own_arguments(monkeypatch):
    """What build_model hands each builder: the wrapped backbone to its optimizer's wrapper, the
    precision to the head's update decision, the context to the triplet loss, the built head and
    its optimizer to the captured step, the device to the scaler."""
    seen = {}
    real_wrap, real_fused = factory.wrap_backbone_optimizer, factory.fused_head_update

    def wrap_backbone_optimizer(cfg, ctx, backbone, opt):
        seen["wrap"] = (ctx, backbone, opt)
        return real_wrap(cfg, ctx, backbone, opt)

    monkeypatch.setattr(factory, "wrap_backbone_optimizer", wrap_backbone_optimizer)
    monkeypatch.setattr(factory, "fused_head_update", lambda cfg, device, amp: seen.setdefault("fused", (device, amp))
                        and real_fused(cfg, device, amp))
    monkeypatch.setattr(factory, "build_head_step", lambda *args: seen.setdefault("step", args) and "the step")
    ctx = DistContext()
    cfg = small(triplet_weight=1.0)
    parts = factory.build_parts(cfg, ctx, 12, (16, 16), 5, torch.float16)
    assert seen["wrap"] == (ctx, parts.backbone, parts.opt_backbone)
    assert seen["fused"] == (CPU, torch.float16)
    assert seen["step"] == (cfg, parts.head, parts.opt_head, CPU) and parts.head_step == "the step"
    assert parts.triplet.ctx is ctx
    assert parts.scaler._device == "cpu" and parts.scaler.is_enabled() is True
    assert factory.build_parts(small(), ctx, 12, (16, 16), 5, torch.bfloat16).scaler.is_enabled() is False


def test_a_captured_head_step_is_refused_on_the_cpu_by_the_builder():
    with pytest.raises(ConfigError, match=r"^cuda_graph='head': the run is on cpu \(a CUDA graph needs CUDA\)"):
        factory.build_parts(small(cuda_graph="head"), DistContext(), 12, (16, 16), 5, None)


@pytest.mark.parametrize("strategy, device, channels_last, converted, said", [
    ("ddp", CPU, True, True, False),  # as use_channels_last says on CUDA (stood in for here)
    ("ddp", CUDA, False, False, False),
    ("horovod", CUDA, True, False, True),
    ("horovod", CPU, True, False, False),
    ("horovod", CUDA, False, False, False),
])
def test_a_backbone_is_prepared_in_channels_last_where_it_is_used(monkeypatch, caplog, strategy, device, channels_last,
                                                                  converted, said):
    kept = []
    monkeypatch.setattr(factory, "keep_boundaries_contiguous", kept.append)
    if device == CPU and strategy == "ddp":
        monkeypatch.setattr(factory, "use_channels_last", lambda cfg, device, module: True)
    cfg = small(strategy=strategy, channels_last=channels_last)
    for stage in (False, True):
        conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
        with caplog.at_level(logging.INFO, logger="shardfc.train"):
            got = (factory.prepare_backbone(cfg, device, conv, pipeline_stage=True) if stage
                   else factory.prepare_backbone(cfg, device, conv))
        assert got[0].weight.is_contiguous(memory_format=torch.channels_last) is converted
        assert kept == ([got] if converted and stage else [])
        assert caplog.messages == (
            ["channels_last is off under strategy 'horovod': its collectives take contiguous tensors only"] if said
            else [])
        caplog.clear()


def test_the_heads_chunk_size_from_the_config():
    placement = {"context": DistContext()}
    got = {n: factory.build_head(small(chunk_size=n), 12, placement).chunk_size for n in (0, -1, 1, 2)}
    assert got == {0: None, -1: "auto", 1: 1, 2: 2}


def test_the_optimizers_get_the_configs_hyper_parameters_and_seed():
    parts = factory.build_parts(small(optimizer="adamw", lr=0.2, backbone_lr_mult=0.5, weight_decay=0.0,
                                      head_dtype="bfloat16", head_rounding="stochastic", seed=7),
                                DistContext(), 12, (16, 16), 5, None)
    backbone, head = parts.opt_backbone.param_groups[0], parts.opt_head.param_groups[0]
    assert type(parts.opt_backbone) is torch.optim.AdamW
    assert backbone["initial_lr"] == pytest.approx(0.1) and backbone["weight_decay"] == 0.0
    assert head["initial_lr"] == pytest.approx(0.2) and head["weight_decay"] == 0.0
    assert head["rounding"] == "stochastic" and head["rounding_seed"] == 7


def test_a_captured_head_step_needs_cuda_and_what_capture_needs(monkeypatch):
    asked = []
    monkeypatch.setattr(factory, "CapturedHeadStep", lambda head, opt: ("captured", head, opt))
    head, opt = object(), object()
    cfg = small(cuda_graph="head")
    assert factory.build_head_step(small(), head, opt, CUDA) is None  # cuda_graph 'off'
    assert factory.build_head_step(cfg, None, None, CUDA) is None  # a pipeline stage without the head
    with pytest.raises(ConfigError) as err:
        factory.build_head_step(cfg, head, opt, CPU)
    assert str(err.value) == "cuda_graph='head': the run is on cpu (a CUDA graph needs CUDA); use cuda_graph 'off'"
    monkeypatch.setattr(factory, "capture_unavailable", lambda h, o: asked.append((h, o)) or "it lacks this")
    with pytest.raises(ConfigError) as err:
        factory.build_head_step(cfg, head, opt, CUDA)
    assert str(err.value) == "cuda_graph='head': it lacks this; use cuda_graph 'off'"
    monkeypatch.setattr(factory, "capture_unavailable", lambda h, o: asked.append((h, o)) and None)
    assert factory.build_head_step(cfg, head, opt, "cuda:0") == ("captured", head, opt)
    assert asked == [(head, opt)] * 2
