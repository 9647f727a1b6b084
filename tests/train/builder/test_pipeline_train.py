"""The pipeline strategy's pieces in this process: evaluation through the stages
(``evaluate_through_pipeline``: an evaluation that fails on stage 0 still sends the other stages their
stop message), the layout's checks, and below, the stage's cut, plan, step and checkpoint helpers with
their collectives stood in for (the spawned tests run them on real ranks, which mutmut cannot see)."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import shardfc.train.builder.pipeline_train as pt
from shardfc.parallel import pipeline_forward
from shardfc.parallel.context import DistContext
from shardfc.parallel.pipeline import PipelineLayout
from shardfc.train.builder.pipeline_train import evaluate_through_pipeline
from shardfc.train.config import ConfigError, TrainConfig
from shardfc.train.state import RunState


def test_a_failed_evaluation_on_stage_0_still_stops_the_other_stages(monkeypatch):
    # PipelinedForward.close broadcasts the stop that ends the other stages' serve_forward
    # (tests/parallel/test_pipeline_forward.py): without it they would wait for the next batch
    # until the process group's timeout.
    closed = []

    class Forward:
        def __init__(self, stage, layout, specs, device, micro_batches):
            self.stage = stage

        def close(self):
            closed.append(self.stage)

    monkeypatch.setattr(pipeline_forward, "PipelinedForward", Forward)
    layout = SimpleNamespace(replica=0, stage=0)
    run = SimpleNamespace(pipeline=SimpleNamespace(layout=layout, specs=[], runner=SimpleNamespace(micro_batches=2)),
                          ctx=SimpleNamespace(device="cpu"), parts=SimpleNamespace(backbone="stage 0"))

    def evaluate(backbone):
        assert isinstance(backbone, Forward)
        raise RuntimeError("the evaluation failed")

    with pytest.raises(RuntimeError, match="the evaluation failed"):
        evaluate_through_pipeline(run, evaluate, contextlib.nullcontext)
    assert closed == ["stage 0"]
    assert evaluate_through_pipeline(run, lambda backbone: {"acc": 1.0}, contextlib.nullcontext) == {"acc": 1.0}
    assert closed == ["stage 0"] * 2


def test_the_other_stages_serve_and_the_other_replicas_return_at_once(monkeypatch):
    """Replica 0's first stage evaluates through a PipelinedForward of the run's own stage, specs,
    device and micro-batches; its other stages serve that forward; other replicas do nothing."""
    calls = []

    class Forward:
        def __init__(self, *args):
            calls.append(("forward", *args))

        def close(self):
            calls.append("close")

    monkeypatch.setattr(pipeline_forward, "PipelinedForward", Forward)
    monkeypatch.setattr(pipeline_forward, "serve_forward", lambda *args: calls.append(("serve", *args)))
    autocast = contextlib.nullcontext

    def run_at(replica, stage):
        layout = SimpleNamespace(replica=replica, stage=stage)
        return SimpleNamespace(pipeline=SimpleNamespace(layout=layout, specs="specs", runner=SimpleNamespace(micro_batches=3)),
                               ctx=SimpleNamespace(device="cpu"), parts=SimpleNamespace(backbone=f"stage {stage}"))

    run = run_at(1, 0)
    assert evaluate_through_pipeline(run, lambda backbone: pytest.fail("another replica evaluated"), autocast) == {}
    assert calls == []
    run = run_at(0, 1)
    assert evaluate_through_pipeline(run, lambda backbone: pytest.fail("stage 1 evaluated"), autocast) == {}
    assert calls == [("serve", "stage 1", run.pipeline.layout, "specs", "cpu", 3, autocast)]
    calls.clear()
    run = run_at(0, 0)
    assert evaluate_through_pipeline(run, lambda backbone: {"acc": 1.0}, autocast) == {"acc": 1.0}
    assert calls == [("forward", "stage 0", run.pipeline.layout, "specs", "cpu", 3), "close"]


def test_a_pipeline_layout_is_checked_before_any_process_starts():
    """``check_pipeline_config``: the backbone's split points counted on the meta device, a split point
    it lacks refused naming the layout, and BatchNorm over several micro-batches refused in full unless
    --micro-batch-stats."""
    from shardfc.models import build_backbone
    from shardfc.parallel.model_split import available_split_points
    from shardfc.train.builder.pipeline_train import check_pipeline_config

    cfg = TrainConfig(strategy="pipeline", pipeline_stages=2, micro_batches=2, micro_batch_stats=True, batch_size=8)
    points = available_split_points(build_backbone("tiny", cfg.embedding_dim), blocks=True)
    assert check_pipeline_config(cfg, 2) == len(points) >= 1
    assert check_pipeline_config(dataclasses.replace(cfg, split_points=[points[0]]), 2) == len(points)
    with pytest.raises(ConfigError, match=r"^strategy='pipeline' on 2 rank\(s\) with backbone='tiny': "):
        check_pipeline_config(dataclasses.replace(cfg, split_points=["no.such.layer"]), 2)
    stages = len(points) + 2  # more stages than the backbone has cuts for
    with pytest.raises(ConfigError, match=rf"^strategy='pipeline' on {stages} rank\(s\) with backbone='tiny': "):
        check_pipeline_config(dataclasses.replace(cfg, pipeline_stages=stages), stages)
    with pytest.raises(ConfigError) as err:
        check_pipeline_config(dataclasses.replace(cfg, micro_batch_stats=False), 2)
    assert str(err.value) == (
        "backbone='tiny' has BatchNorm ('body.1'), which in training normalises each of the micro_batches=2 "
        "micro-batches with its own statistics, unlike an unpipelined step of batch_size rows: pass "
        "--micro-batch-stats to accept that (the semantics of --grad-accum over micro-batches), or "
        "--micro-batches 1 --pipeline-schedule gpipe")
    assert check_pipeline_config(dataclasses.replace(cfg, micro_batch_stats=False, micro_batches=1), 2) == len(points)


# ---------------------------------------------------------------------- in this process (a world of one)
# The spawned tests (test_pipeline_strategy.py, test_pipeline_four_stages.py, test_builder.py) run every
# function below on its real ranks; mutation testing sees only the test's own process, so each is run
# here too, its collectives and torch.distributed's point-to-point calls stood in for.

CPU = torch.device("cpu")


class Reducer:
    """A DistContext stand-in whose all-reduce adds ``extra`` (another rank's share) and records the tensor."""

    def __init__(self, extra=0.0, comm_device=CPU):
        self.extra, self.comm_device, self.device, self.reduced = extra, comm_device, CPU, []

    def all_reduce_(self, t, op="sum"):
        self.reduced.append(t.clone())
        t += self.extra
        return t


def layout_at(stage, stages=3, replica=1, replicas=2, replica_ctx=None, pipe_ctx=None):
    return PipelineLayout(stages, replicas, stage, replica, "pipe group", replica_ctx or DistContext(),
                          pipe_ctx or DistContext())


def test_the_layout_is_created_over_the_world_with_the_configs_stages_and_the_backbones_cuts(monkeypatch):
    asked = []
    monkeypatch.setattr(pt, "check_pipeline_config", lambda cfg, world: asked.append(("check", cfg, world)) or 7)
    monkeypatch.setattr(pt, "create_layout", lambda *args: asked.append(("create", *args)) or "layout")
    cfg, ctx = TrainConfig(strategy="pipeline", pipeline_stages=3), DistContext(world_size=6)
    assert pt.pipeline_layout(cfg, ctx) == "layout"
    assert asked == [("check", cfg, 6), ("create", ctx, 3, 7)]


def test_the_first_stage_sends_its_labels_to_the_last_one_and_counts_them(monkeypatch):
    import shardfc.parallel.collectives as collectives

    sent, counted = [], []
    monkeypatch.setattr(torch.distributed, "send", lambda t, dst, group: sent.append((t, dst, group)))
    monkeypatch.setattr(torch.distributed, "recv", lambda *a, **k: pytest.fail("the first stage received"))
    monkeypatch.setattr(collectives, "record_comm_bytes", lambda kind, n: counted.append((kind, n)))
    labels = torch.tensor([[3, 1], [4, 1], [5, 9]], dtype=torch.int32).t()  # not contiguous, not int64
    assert pt._labels_to_last_stage(layout_at(0), labels, 3, CPU) is None
    [(t, dst, group)] = sent
    assert t.dtype is torch.int64 and t.is_contiguous() and t.tolist() == [[3, 4, 5], [1, 1, 9]]
    assert dst == 2 * 2 + 1 and group == "pipe group"  # stage 2 of replica 1
    assert counted == [(pt.STAGE_LABELS, 6 * 8)] and pt.STAGE_LABELS == "pipeline_labels"


def test_the_last_stage_receives_the_labels_from_the_first_and_a_middle_stage_neither(monkeypatch):
    import shardfc.parallel.collectives as collectives

    got = []

    def recv(t, src, group):
        got.append((t.shape, t.dtype, t.device, src, group))
        t.copy_(torch.arange(t.numel()) + 10)

    monkeypatch.setattr(torch.distributed, "recv", recv)
    monkeypatch.setattr(torch.distributed, "send", lambda *a, **k: pytest.fail("sent"))
    monkeypatch.setattr(collectives, "record_comm_bytes", lambda *a: pytest.fail("counted"))
    out = pt._labels_to_last_stage(layout_at(2), None, 4, CPU)
    assert out.tolist() == [10, 11, 12, 13] and out.dtype is torch.int64
    assert got == [(torch.Size([4]), torch.int64, CPU, 1, "pipe group")]  # stage 0 of replica 1
    assert pt._labels_to_last_stage(layout_at(1), None, 4, CPU) is None and len(got) == 1


def test_the_steps_loss_comes_from_replica_0s_last_stage_only():
    plan = SimpleNamespace(layout=layout_at(2, replica=0), losses=[torch.tensor(1.5), torch.tensor(0.25)])
    ctx = Reducer(extra=0.5)
    loss = pt.share_loss(plan, ctx)
    assert loss.item() == 1.75 + 0.5 and loss.device == CPU and ctx.reduced[0].item() == 1.75
    for stage, replica in ((2, 1), (1, 0), (0, 0)):
        ctx = Reducer(extra=0.5)
        plan = SimpleNamespace(layout=layout_at(stage, replica=replica), losses=[torch.tensor(1.5)])
        assert pt.share_loss(plan, ctx).item() == 0.5 and ctx.reduced[0].item() == 0.0


def test_the_backbones_gradient_is_clipped_by_its_norm_over_every_stage():
    a, b, c = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # c has none
    pipe = Reducer(extra=11.0)  # the other stages' squared norm: 25 + 11 = 36
    plan = SimpleNamespace(layout=layout_at(1, pipe_ctx=pipe))
    total = pt.clip_stage_grads_([a, b, c], 3.0, plan)
    assert total.item() == pytest.approx(6.0) and pipe.reduced[0].item() == 25.0
    assert a.grad.tolist() == pytest.approx([1.5, 0.0]) and b.grad.tolist() == pytest.approx([2.0]) and c.grad is None
    coef = 3.0 / (6.0 + 1e-6)
    assert a.grad[0].item() == pytest.approx(3 * coef, rel=1e-7)
    # under the limit: unchanged
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert pt.clip_stage_grads_([a, b], 10.0, SimpleNamespace(layout=layout_at(0, pipe_ctx=Reducer()))).item() == 5.0
    assert a.grad.tolist() == [3.0, 0.0] and b.grad.tolist() == [4.0]


class Runner:
    """A PipelineRunner stand-in: its arguments recorded, each step's (images, labels, autocast on) too."""

    def __init__(self, module, layout, device, **kwargs):
        self.args, self.kwargs = (module, layout, device), kwargs
        self.local_batch, self.micro_batches, self.steps = kwargs["local_batch"], kwargs["micro_batches"], []

    def step(self, images, labels):
        self.steps.append((images, labels, torch.is_autocast_enabled("cpu")))


class Scaler:
    def scale(self, loss):
        return loss * 1024


def test_the_stages_schedule_is_built_around_its_parts_with_the_last_stages_loss(monkeypatch):
    monkeypatch.setattr(pt, "PipelineRunner", Runner)
    cfg = TrainConfig(strategy="pipeline", pipeline_stages=3, pipeline_schedule="1f1b", micro_batches=4, grad_accum=2,
                      batch_size=16, micro_batch_stats=True)
    specs = (((3, 8, 8), torch.float32), ((4, 4, 4), torch.bfloat16), ((8,), torch.float16), ((8,), torch.float32))
    stage = pt.StageCut(nn.Linear(1, 1), ("a", "b"), ("k1", "k2"), ("p1", "p2"), ("p2",), specs)
    seen = []

    def head(embeddings, labels):
        seen.append((embeddings, labels))
        return (embeddings * labels).sum()

    backbone, layout = nn.Linear(2, 2), layout_at(1)
    parts = SimpleNamespace(head=head, scaler=Scaler(), backbone=backbone)
    plan = pt.pipeline_plan(cfg, DistContext(), layout, stage, parts)
    runner = plan.runner
    assert runner.args == (backbone, layout, CPU)
    loss_fn = runner.kwargs.pop("loss_fn")
    assert runner.kwargs == dict(schedule="1f1b", micro_batches=4, local_batch=16, specs=(specs[1], specs[2]),
                                 allow_micro_batch_stats=True)
    assert plan.layout is layout and plan.split_points == ("a", "b") and plan.state_keys == ("k1", "k2")
    assert plan.param_names == ("p1", "p2") and plan.stage_param_names == ("p2",) and plan.specs is specs
    assert plan.losses == []
    emb = torch.tensor([2.0, 3.0], requires_grad=True)
    scaled = loss_fn(emb, torch.tensor([1.0, 2.0]))
    assert seen[0][0] is emb and scaled.item() == 8.0 / 8 * 1024  # weight 1 / (4 micro-batches * 2 accumulated)
    [recorded] = plan.losses
    assert recorded.item() == 1.0 and recorded.dtype is torch.float32 and not recorded.requires_grad
    scaled.backward()
    assert emb.grad.tolist() == [1024 / 8, 2048 / 8]
    emb = torch.tensor([2.0], dtype=torch.bfloat16)
    loss_fn(emb, torch.tensor([1.0], dtype=torch.bfloat16))
    assert plan.losses[-1].dtype is torch.float32 and plan.losses[-1].item() == 0.25
    # a stage without the head has no loss
    parts = SimpleNamespace(head=None, scaler=Scaler(), backbone=backbone)
    plan = pt.pipeline_plan(dataclasses.replace(cfg, micro_batch_stats=False, pipeline_schedule="gpipe"),
                            DistContext(), layout_at(0), stage, parts)
    assert plan.runner.kwargs == dict(schedule="gpipe", micro_batches=4, local_batch=16, specs=(specs[0], specs[1]),
                                      loss_fn=None, allow_micro_batch_stats=False)


def step_parts(opt_head=None):
    backbone = nn.Linear(2, 1)
    for p in backbone.parameters():
        p.grad = torch.ones_like(p)
    return SimpleNamespace(backbone=backbone, opt_backbone=torch.optim.SGD(backbone.parameters(), lr=0.1),
                           opt_head=opt_head)


class HeadOptimizer:
    def __init__(self):
        self.calls = []

    def zero_grad(self, set_to_none=True):
        self.calls.append(set_to_none)


def test_a_first_stage_step_reads_its_batches_and_sends_its_labels(monkeypatch):
    averaged, sent = [], []
    monkeypatch.setattr(pt, "average_gradients_", lambda params, ctx: averaged.append((params, ctx)))
    monkeypatch.setattr(pt, "_labels_to_last_stage",
                        lambda layout, labels, rows, device: sent.append((layout, labels, rows, device)) or "theirs")
    monkeypatch.setattr(pt, "share_loss", lambda plan, ctx: ("loss", plan, ctx))
    replicas = DistContext()
    layout = layout_at(0, replicas=3, replica_ctx=replicas)
    runner = Runner(None, layout, CPU, local_batch=2, micro_batches=1)
    plan = SimpleNamespace(layout=layout, runner=runner, losses=[torch.tensor(9.0)])
    parts = step_parts()
    frozen = nn.Parameter(torch.zeros(1), requires_grad=False)
    parts.backbone.frozen = frozen
    batches = [(torch.ones(2, 3), torch.tensor([1, 2]), [("a.jpg", "truncated")]),
               (torch.zeros(2, 3), torch.tensor([3, 4]), []),
               (torch.ones(2, 3), torch.tensor([5, 6]), [("b.jpg", "empty")])]
    stream, state = iter(batches), RunState(samples_seen=5)
    cfg, ctx = TrainConfig(strategy="pipeline", grad_accum=2), DistContext()
    loss, corrupt = pt.pipeline_step(parts, plan, stream, state, cfg, ctx, lambda: torch.autocast("cpu"))
    assert loss == ("loss", plan, ctx) and corrupt == [("a.jpg", "truncated")]
    assert plan.losses == [] and state.samples_seen == 5 + 2 * 2 * 3
    assert all(p.grad is None for p in parts.backbone.parameters())  # zeroed before the step
    assert [(labels, rows) for _, labels, rows, _ in sent] == [(batches[0][1], 2), (batches[1][1], 2)]
    assert all(s[0] is layout and s[3] == CPU for s in sent)
    assert [(images.sum().item(), labels, on) for images, labels, on in runner.steps] == [
        (6.0, "theirs", True), (0.0, "theirs", True)]
    [(params, avg_ctx)] = averaged
    assert avg_ctx is replicas and [id(p) for p in params] == [id(p) for p in (parts.backbone.weight, parts.backbone.bias)]
    assert next(stream)[2] == [("b.jpg", "empty")]  # two batches read: grad_accum


def test_a_later_stage_step_walks_the_row_counts_and_zeroes_the_heads_gradient_in_place(monkeypatch):
    monkeypatch.setattr(pt, "average_gradients_", lambda params, ctx: None)
    monkeypatch.setattr(pt, "_labels_to_last_stage", lambda layout, labels, rows, device: ("labels", labels, rows))
    layout = layout_at(2, replicas=2)
    runner = Runner(None, layout, CPU, local_batch=4, micro_batches=2)
    plan = SimpleNamespace(layout=layout, runner=runner, losses=[])
    head_opt = HeadOptimizer()
    parts = step_parts(head_opt)
    state = RunState()
    cfg, ctx = TrainConfig(strategy="pipeline", grad_accum=3), DistContext()
    loss, corrupt = pt.pipeline_step(parts, plan, iter([4, 4, 4, 1]), state, cfg, ctx, contextlib.nullcontext)
    assert head_opt.calls == [False] and corrupt == [] and state.samples_seen == 3 * 4 * 2
    assert runner.steps == [(None, ("labels", None, 4), False)] * 3
    assert loss.item() == 0.0  # no loss recorded on this rank (a later stage of replica 1)
    with pytest.raises(ValueError) as err:
        pt.pipeline_step(parts, plan, iter([3]), state, cfg, ctx, contextlib.nullcontext)
    assert str(err.value) == (
        "pipeline: a local batch of 3 rows, but the schedule was built for local_batch=4 (micro-batches have a "
        "fixed shape: every step needs the same batch)")
    assert len(runner.steps) == 3 and state.samples_seen == 24


def three_linears():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 40), nn.Linear(40, 2))
    model[1].bias.requires_grad_(False)  # frozen: not the optimizer's
    return model


def test_a_stage_is_cut_alone_at_the_configs_points_else_balanced(monkeypatch):
    """``cut_stage``: stage ``layout.stage`` of the builder's backbone with the whole build's values, the whole
    model's keys and trainable parameters, the stage's own, and the chained specs asked of the stage alone."""
    asked = []

    def chained_activation_specs(module, layout, input_spec, device, autocast):
        asked.append((module, layout, input_spec, device, autocast))
        return [((4,), torch.float32), ((40,), torch.float32), ((2,), torch.float32)]

    monkeypatch.setattr(pt, "chained_activation_specs", chained_activation_specs)
    torch.manual_seed(3)
    whole = three_linears()
    layout = layout_at(1, stages=2)
    cfg, ctx = TrainConfig(strategy="pipeline", pipeline_stages=2), DistContext()
    torch.manual_seed(3)
    cut = pt.cut_stage(cfg, ctx, layout, three_linears, (5, 7), "autocast")
    assert cut.split_points == ("1",)  # balanced: 220 parameters | 82
    assert cut.state_keys == ("0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias")
    assert cut.param_names == ("0.weight", "0.bias", "1.weight", "2.weight", "2.bias")
    assert cut.stage_param_names == ("2.weight", "2.bias")
    assert cut.specs == (((4,), torch.float32), ((40,), torch.float32), ((2,), torch.float32))
    assert dict(cut.module.state_dict()).keys() == {"2.weight", "2.bias"}
    assert all(torch.equal(t, whole.state_dict()[k]) and t.device == CPU for k, t in cut.module.state_dict().items())
    [(module, lay, input_spec, device, autocast)] = asked
    assert module is cut.module and lay is layout and device == CPU and autocast == "autocast"
    assert input_spec == ((3, 5, 7), torch.float32)
    # the config's split points win; stage 0 of those
    cut = pt.cut_stage(dataclasses.replace(cfg, split_points=["0"]), ctx, layout_at(0, stages=2), three_linears,
                       (5, 7), "autocast")
    assert cut.split_points == ("0",) and cut.stage_param_names == ("0.weight", "0.bias")
    cut = pt.cut_stage(dataclasses.replace(cfg, split_points=["0"]), ctx, layout, three_linears, (5, 7), None)
    assert cut.stage_param_names == ("1.weight", "2.weight", "2.bias")
    assert cut.param_names == ("0.weight", "0.bias", "1.weight", "2.weight", "2.bias")


def test_a_cut_the_backbone_cannot_have_is_a_config_error():
    cfg, ctx = TrainConfig(strategy="pipeline", pipeline_stages=2, split_points=["no.such"]), DistContext()
    with pytest.raises(ConfigError, match=r"^split_points: split_points: unknown split point .no.such. for Sequential") as err:
        pt.cut_stage(cfg, ctx, layout_at(1, stages=2), three_linears, (5, 7), None)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(ConfigError, match=r"^split_points: pipeline_stages=4 but the backbone has 2 split point"):
        pt.cut_stage(dataclasses.replace(cfg, split_points=[]), ctx, layout_at(1, stages=4), three_linears, (5, 7), None)


# ---------------------------------------------------------------------- checkpoints per stage, in this process


def trained(model):
    """``model`` and an SGD with momentum over its trainable parameters, after one step (so it has state)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return opt


def whole_and_stage():
    """A trained whole backbone and its optimizer; stage 1 (``2.*``) of it and a fresh optimizer, as a pipeline rank holds."""
    from shardfc.parallel.stage_build import build_stage

    torch.manual_seed(0)
    whole = three_linears()
    opt = trained(whole)
    stage = build_stage(three_linears, 1, lambda model: ["1"]).stages[1]
    stage_opt = torch.optim.SGD(stage.parameters(), lr=0.5, momentum=0.5)
    plan = SimpleNamespace(layout=layout_at(1, stages=2, replica=0), stage_param_names=("2.weight", "2.bias"),
                           state_keys=tuple(whole.state_dict()),
                           param_names=tuple(n for n, p in whole.named_parameters() if p.requires_grad))
    parts = SimpleNamespace(backbone=stage, module=stage, opt_backbone=stage_opt, scaler=None)
    return whole, opt, parts, plan


def test_a_stages_share_of_a_checkpoint_is_its_entries_and_optimizer_under_the_whole_models_names():
    _, _, parts, plan = whole_and_stage()
    parts.backbone(torch.ones(2, 40)).sum().backward()
    parts.opt_backbone.step()
    part = pt.stage_part(parts, plan)
    assert part.index == 1 and part.writes is True
    assert list(part.model) == ["2.weight", "2.bias"] and torch.equal(part.model["2.bias"], parts.backbone[0].bias)
    assert part.optimizer == pt.optimizer_by_name(parts.opt_backbone.state_dict(), ("2.weight", "2.bias"))
    assert set(part.optimizer["state"]) == {"2.weight", "2.bias"}
    assert part.all_keys == plan.state_keys and part.all_params == plan.param_names
    plan.layout = layout_at(1, stages=2, replica=1)
    assert pt.stage_part(parts, plan).writes is False


def test_the_scaler_state_comes_from_the_last_stage_to_world_rank_0(monkeypatch):
    gathered = []

    def gather_object_to(layout, obj, dst_stage):
        gathered.append((layout, obj, dst_stage))
        return None if layout.stage else [{"scale": 1.0}, {"scale": 2.0}, {"scale": 3.0}]

    monkeypatch.setattr(pt, "gather_object_to", gather_object_to)
    scaler = SimpleNamespace(is_enabled=lambda: True, state_dict=lambda: {"scale": 7.0})
    parts, layout = SimpleNamespace(scaler=scaler), layout_at(0, replica=0)
    assert pt.stage_scaler_state(parts, SimpleNamespace(layout=layout)) == {"scale": 3.0}
    assert gathered == [(layout, {"scale": 7.0}, 0)]
    assert pt.stage_scaler_state(parts, SimpleNamespace(layout=layout_at(2, replica=0))) is None
    # a stage other than 0 that got the states would still not return them
    monkeypatch.setattr(pt, "gather_object_to", lambda layout, obj, dst_stage: [{"scale": 1.0}])
    assert pt.stage_scaler_state(parts, SimpleNamespace(layout=layout_at(1, replica=0))) is None
    monkeypatch.setattr(pt, "gather_object_to", lambda *a, **k: pytest.fail("gathered with the scaler off"))
    off = SimpleNamespace(is_enabled=lambda: False, state_dict=lambda: {})
    assert pt.stage_scaler_state(SimpleNamespace(scaler=off), SimpleNamespace(layout=layout)) is None


def test_a_stage_loads_its_entries_and_optimizer_from_a_whole_backbones_state():
    whole, opt, parts, plan = whole_and_stage()
    model = dict(whole.state_dict())
    with torch.no_grad():
        model["2.weight"] = model["2.weight"] + 1
    by_name = pt.whole_optimizer_by_name(opt.state_dict(), plan)
    assert set(by_name["state"]) == set(plan.param_names)
    pt.load_stage_state(parts, plan, model, by_name)
    assert torch.equal(parts.backbone[0].weight, whole[2].weight + 1) and torch.equal(parts.backbone[0].bias, whole[2].bias)
    loaded = parts.opt_backbone.state_dict()
    assert torch.equal(loaded["state"][0]["momentum_buffer"], opt.state_dict()["state"][3]["momentum_buffer"])
    assert loaded["param_groups"][0]["lr"] == 0.1 and loaded["param_groups"][0]["momentum"] == 0.9
    # weights alone: the optimizer starts fresh
    _, _, parts, plan = whole_and_stage()
    pt.load_stage_state(parts, plan, model, None)
    assert torch.equal(parts.backbone[0].weight, model["2.weight"]) and parts.opt_backbone.state_dict()["state"] == {}
    assert parts.opt_backbone.state_dict()["param_groups"][0]["lr"] == 0.5


def test_a_backbone_without_the_stages_keys_is_refused_naming_five():
    _, _, parts, plan = whole_and_stage()
    with pytest.raises(ConfigError) as err:
        pt.load_stage_state(parts, plan, {"2.weight": torch.zeros(2, 40)}, None)
    assert str(err.value) == "the checkpoint's backbone has no ['2.bias']: saved by another architecture?"
    parts.backbone = nn.Sequential(*(nn.Linear(1, 1) for _ in range(4)))
    with pytest.raises(ConfigError) as err:
        pt.load_stage_state(parts, plan, {"0.weight": torch.zeros(1, 1)}, None)
    assert str(err.value) == ("the checkpoint's backbone has no ['0.bias', '1.weight', '1.bias', '2.weight', '2.bias']: "
                              "saved by another architecture?")


def test_a_whole_optimizer_must_cover_the_whole_backbones_parameters():
    _, opt, _, plan = whole_and_stage()
    state = opt.state_dict()
    assert pt.whole_optimizer_by_name(state, plan) == pt.optimizer_by_name(state, plan.param_names)
    plan.param_names = plan.param_names[:-1]
    with pytest.raises(ConfigError) as err:
        pt.whole_optimizer_by_name(state, plan)
    assert str(err.value) == "the checkpoint's backbone optimizer covers 5 parameters, the backbone has 4"
    with pytest.raises(ConfigError) as err:
        pt.whole_optimizer_by_name({"state": {}, "param_groups": []}, plan)
    assert str(err.value) == "the checkpoint's backbone optimizer covers 0 parameters, the backbone has 4"
    plan.param_names = ()
    assert pt.whole_optimizer_by_name({"state": {}, "param_groups": []}, plan) == {"state": {}, "param_groups": []}


def whole_parts():
    torch.manual_seed(1)
    model = three_linears()
    return SimpleNamespace(backbone=model, module=model,
                           opt_backbone=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5,
                                                        momentum=0.5))


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_whole_backbone_in_the_common_file_restores_an_unsplit_run_or_a_stage(with_optimizer):
    whole, opt, parts, plan = whole_and_stage()
    common = {"backbone": whole.state_dict(), "backbone_optimizer": opt.state_dict()}
    loaded = SimpleNamespace(common=common, path="unread", meta={})
    cfg = TrainConfig()
    fresh = whole_parts()
    # (what it returns matters to a resume only, which loads the optimizer)
    held = pt.restore_backbone(SimpleNamespace(parts=fresh, pipeline=None), loaded, cfg, with_optimizer)
    assert held is True or not with_optimizer
    assert all(torch.equal(a, b) for a, b in zip(fresh.module.state_dict().values(), whole.state_dict().values()))
    lr = fresh.opt_backbone.state_dict()["param_groups"][0]["lr"]
    assert (lr, len(fresh.opt_backbone.state_dict()["state"])) == ((0.1, 5) if with_optimizer else (0.5, 0))
    held = pt.restore_backbone(SimpleNamespace(parts=parts, pipeline=plan), loaded, cfg, with_optimizer)
    assert held is True or not with_optimizer
    assert torch.equal(parts.backbone[0].weight, whole[2].weight)
    lr = parts.opt_backbone.state_dict()["param_groups"][0]["lr"]
    assert (lr, len(parts.opt_backbone.state_dict()["state"])) == ((0.1, 2) if with_optimizer else (0.5, 0))
    # an import: weights alone
    loaded.common = {"backbone": whole.state_dict()}
    fresh = whole_parts()
    assert pt.restore_backbone(SimpleNamespace(parts=fresh, pipeline=None), loaded, cfg, with_optimizer) is False
    assert torch.equal(fresh.module[0].weight, whole[0].weight) and fresh.opt_backbone.state_dict()["state"] == {}
    _, _, parts, plan = whole_and_stage()
    assert pt.restore_backbone(SimpleNamespace(parts=parts, pipeline=plan), loaded, cfg, with_optimizer) is False
    assert torch.equal(parts.backbone[0].weight, whole[2].weight) and parts.opt_backbone.state_dict()["state"] == {}


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_per_stage_checkpoint_restores_an_unsplit_run_or_only_a_stages_keys(monkeypatch, with_optimizer):
    whole, opt, parts, plan = whole_and_stage()
    by_name = pt.whole_optimizer_by_name(opt.state_dict(), plan)
    read = []

    def read_stage_state(path, meta, keys=None, params=None, *, trust_pickle):
        read.append((path, meta, keys, params, trust_pickle))
        return whole.state_dict(), by_name

    monkeypatch.setattr(pt, "read_stage_state", read_stage_state)
    loaded = SimpleNamespace(common={"head": 1}, path="ckpt/step_5", meta={"stages": 2})
    cfg = TrainConfig(trust_checkpoint=True)
    fresh = whole_parts()
    assert pt.restore_backbone(SimpleNamespace(parts=fresh, pipeline=None), loaded, cfg, with_optimizer) is True
    assert read == [("ckpt/step_5", {"stages": 2}, None, None, True)]
    assert all(torch.equal(a, b) for a, b in zip(fresh.module.state_dict().values(), whole.state_dict().values()))
    state = fresh.opt_backbone.state_dict()
    assert (state["param_groups"][0]["lr"], len(state["state"])) == ((0.1, 5) if with_optimizer else (0.5, 0))
    if with_optimizer:
        assert torch.equal(state["state"][3]["momentum_buffer"], opt.state_dict()["state"][3]["momentum_buffer"])
    read.clear()
    cfg = TrainConfig(trust_checkpoint=False)
    assert pt.restore_backbone(SimpleNamespace(parts=parts, pipeline=plan), loaded, cfg, with_optimizer) is True
    assert read == [("ckpt/step_5", {"stages": 2}, ["2.weight", "2.bias"], ("2.weight", "2.bias"), False)]
    assert torch.equal(parts.backbone[0].weight, whole[2].weight)
    state = parts.opt_backbone.state_dict()
    assert (state["param_groups"][0]["lr"], len(state["state"])) == ((0.1, 2) if with_optimizer else (0.5, 0))


# ---------------------------------------------------------------------- the stage's data and boundaries


class Batches:
    """A sampler stand-in: two batches an epoch, its set_epoch calls recorded."""

    def __init__(self, epoch_batches):
        self.epoch_batches, self.epochs = epoch_batches, []

    def set_epoch(self, epoch, start=0):
        self.epochs.append((epoch, start))

    def __iter__(self):
        return iter(self.epoch_batches[self.epochs[-1][1]:])


def test_a_later_stage_walks_the_batch_order_as_row_counts_and_a_first_stage_loads(monkeypatch):
    from shardfc.train.loader import data
    from shardfc.train.observe.phases import OFF

    loaded = []
    monkeypatch.setattr(data, "micro_batches", lambda *args, clock: loaded.append((*args, clock)) or "images")
    batches, state = Batches([[1, 2, 3], [4, 5]]), RunState(epoch=2, batch_in_epoch=1)
    cfg, ctx = TrainConfig(), DistContext()
    rows = pt.stage_stream("dataset", batches, state, cfg, ctx, layout_at(1))
    assert [next(rows) for _ in range(3)] == [2, 3, 2]
    assert batches.epochs == [(2, 1), (3, 0)] and (state.epoch, state.batch_in_epoch) == (3, 2)
    assert next(rows) == 3 and batches.epochs[-1] == (4, 0) and (state.epoch, state.batch_in_epoch) == (4, 1)
    assert pt.stage_stream("dataset", batches, state, cfg, ctx, layout_at(2), clock="clock") is not None
    assert loaded == []
    assert pt.stage_stream("dataset", batches, state, cfg, ctx, layout_at(0), clock="clock") == "images"
    assert pt.stage_stream("dataset", batches, state, cfg, ctx, layout_at(0)) == "images"
    assert loaded == [("dataset", batches, state, cfg, ctx, "clock"), ("dataset", batches, state, cfg, ctx, OFF)]


def test_a_channels_last_stage_takes_and_hands_on_contiguous_tensors():
    seen = []

    class Stage(nn.Module):
        def forward(self, x, y, flag):
            seen.append((x.is_contiguous(memory_format=torch.channels_last), x.is_contiguous(), y.is_contiguous(), flag))
            return x.contiguous(memory_format=torch.channels_last) * 2

    stage = Stage()
    pt.keep_boundaries_contiguous(stage)
    x, y = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5), torch.arange(6.0).reshape(2, 3).t()
    out = stage(x, y, "flag")
    assert seen == [(True, False, False, "flag")]  # only the 4-d tensor is converted
    assert out.is_contiguous() and torch.equal(out, x * 2)

    class Pair(nn.Module):
        def forward(self, x):
            return (x, x)

    pair = Pair()
    pt.keep_boundaries_contiguous(pair)
    x = torch.zeros(1, 2, 3, 3)
    first, _ = pair(x)
    assert first.is_contiguous(memory_format=torch.channels_last) and not first.is_contiguous()


# ---------------------------------------------------------------------- where each tensor goes (mutmut's survivors)
# This machine has one real device; the meta device stands in for "another one" where a tensor's place is checked.

META = torch.device("meta")


def test_the_probe_is_the_runs_own_backbone_built_on_the_meta_device(monkeypatch):
    built = []
    real = pt.build_backbone

    def build_backbone(name, *args, **kwargs):
        built.append((name, args, kwargs, torch.empty(0).device))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(pt, "build_backbone", build_backbone)
    cfg = TrainConfig(strategy="pipeline", pipeline_stages=2, embedding_dim=24, micro_batch_stats=True)
    pt.check_pipeline_config(cfg, 2)
    assert built == [("tiny", (24,), {"input_size": (32, 32)}, META)]


def test_a_stage_is_moved_to_the_runs_device(monkeypatch):
    monkeypatch.setattr(pt, "chained_activation_specs", lambda module, layout, spec, device, autocast: [device])
    ctx = SimpleNamespace(device=META)
    cut = pt.cut_stage(TrainConfig(strategy="pipeline"), ctx, layout_at(1, stages=2), three_linears, (5, 7), None)
    assert {p.device for p in cut.module.parameters()} == {META} and cut.specs == (META,)


class Labels:
    """Labels as the loader hands them, their ``to`` recorded."""

    def __init__(self, values):
        self.values, self.to_calls = values, []

    def to(self, *args, **kwargs):
        self.to_calls.append((args, kwargs))
        return self.values.to(*args, **kwargs)


def test_the_labels_are_sent_and_received_on_the_runs_device(monkeypatch):
    import shardfc.parallel.collectives as collectives

    sent = []
    monkeypatch.setattr(torch.distributed, "send", lambda t, dst, group: sent.append(t))
    monkeypatch.setattr(torch.distributed, "recv", lambda t, src, group: sent.append(t))
    monkeypatch.setattr(collectives, "record_comm_bytes", lambda kind, n: None)
    labels = Labels(torch.tensor([1, 2], dtype=torch.int32))
    pt._labels_to_last_stage(layout_at(0), labels, 2, META)
    assert labels.to_calls == [((), {"device": META, "dtype": torch.int64})] and sent[0].device == META
    out = pt._labels_to_last_stage(layout_at(2), None, 2, META)
    assert out.device == META and sent[1] is out


class Images:
    """A batch of images as the loader hands them: its rows, and its ``to`` recorded."""

    def __init__(self, rows):
        self.shape, self.to_calls = (rows, 3, 4, 4), []

    def to(self, *args, **kwargs):
        self.to_calls.append((args, kwargs))
        return "on the device"


def test_a_first_stage_copies_its_images_to_the_device_without_blocking(monkeypatch):
    monkeypatch.setattr(pt, "average_gradients_", lambda params, ctx: None)
    monkeypatch.setattr(pt, "_labels_to_last_stage", lambda layout, labels, rows, device: None)
    layout = layout_at(0)
    runner = Runner(None, layout, CPU, local_batch=2, micro_batches=1)
    plan = SimpleNamespace(layout=layout, runner=runner, losses=[])
    images = Images(2)
    ctx = SimpleNamespace(device=META, comm_device=CPU, all_reduce_=lambda t: t)
    pt.pipeline_step(step_parts(), plan, iter([(images, None, [])]), RunState(), TrainConfig(strategy="pipeline"),
                     ctx, contextlib.nullcontext)
    assert images.to_calls == [((META,), {"non_blocking": True})] and runner.steps[0][0] == "on the device"


def test_the_shared_loss_is_reduced_as_float32_on_the_comm_device_and_returned_on_the_runs():
    losses = [torch.tensor(1.5, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64)]
    comm = Reducer(comm_device=META)
    comm.device = META
    loss = pt.share_loss(SimpleNamespace(layout=layout_at(2, replica=0), losses=losses), comm)
    assert comm.reduced[0].device == META and comm.reduced[0].dtype is torch.float32 and loss.device == META
    comm = Reducer()  # reduced on the CPU (gloo), the run on another device
    comm.device = META
    loss = pt.share_loss(SimpleNamespace(layout=layout_at(2, replica=0), losses=losses), comm)
    assert comm.reduced[0].device == CPU and comm.reduced[0].dtype is torch.float32 and comm.reduced[0].item() == 1.75
    assert loss.device == META


def test_the_norm_over_the_stages_is_reduced_in_float32_on_the_pipes_comm_device():
    a = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    a.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    pipe = Reducer()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        total = pt.clip_stage_grads_([a], 1.0, SimpleNamespace(layout=layout_at(0, pipe_ctx=pipe)))
    finally:
        torch.set_default_dtype(default)
    assert pipe.reduced[0].dtype is torch.float32 and total.dtype is torch.float32 and total.item() == 5.0
    b = nn.Parameter(torch.zeros(2, device=META))
    b.grad = torch.zeros(2, device=META)
    pipe = Reducer(comm_device=META)
    pt.clip_stage_grads_([b], 1.0, SimpleNamespace(layout=layout_at(0, pipe_ctx=pipe)))
    assert pipe.reduced[0].device == META


def test_a_restore_loads_the_optimizer_unless_told_not_to():
    whole, opt, _, _ = whole_and_stage()
    loaded = SimpleNamespace(common={"backbone": whole.state_dict(), "backbone_optimizer": opt.state_dict()})
    fresh = whole_parts()
    assert pt.restore_backbone(SimpleNamespace(parts=fresh, pipeline=None), loaded, TrainConfig()) is True
    assert len(fresh.opt_backbone.state_dict()["state"]) == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_gradient_is_scaled_by_the_coefficient_in_its_own_dtype(dtype):
    torch.manual_seed(0)
    a = nn.Parameter(torch.zeros(1000, dtype=dtype))
    a.grad = torch.randn(1000).to(dtype)
    before = a.grad.clone()
    total = pt.clip_stage_grads_([a], 0.123456789, SimpleNamespace(layout=layout_at(0, pipe_ctx=Reducer())))
    coef = (0.123456789 / (total + 1e-6)).clamp(max=1.0)
    assert torch.equal(a.grad, before * coef.to(dtype))
    assert not torch.equal(a.grad, before.clone().mul_(coef))  # the float32 coefficient would round otherwise


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a second real device: CUDA")
def test_the_loss_and_the_norm_cross_from_the_runs_cuda_device_to_a_cpu_comm_device():
    """Under gloo with CUDA ranks the collectives' tensors are on the CPU, the losses and gradients on
    the GPU: each crosses explicitly (an in-place CPU op refuses a CUDA operand)."""
    cuda = torch.device("cuda")
    comm = Reducer()
    comm.device = cuda
    losses = [torch.tensor(1.5, device=cuda), torch.tensor(0.25, device=cuda)]
    loss = pt.share_loss(SimpleNamespace(layout=layout_at(2, replica=0), losses=losses), comm)
    assert loss.device.type == "cuda" and loss.item() == 1.75 and comm.reduced[0].device == CPU
    a = nn.Parameter(torch.zeros(2, device=cuda))
    a.grad = torch.tensor([3.0, 4.0], device=cuda)
    pipe = Reducer()
    assert pt.clip_stage_grads_([a], 1.0, SimpleNamespace(layout=layout_at(0, pipe_ctx=pipe))).item() == 5.0
    assert pipe.reduced[0].device == CPU and a.grad.device.type == "cuda"
    assert a.grad.tolist() == pytest.approx([0.6, 0.8])
