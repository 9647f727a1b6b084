"""The pipeline's grid, groups, gathers and stage runner in the test's own process: ranks as threads
(:class:`tests.thread_world.TorchThreadWorld`, torch's in-process backend), so that mutation testing
sees them. torch's threaded backend has no point-to-point sends, so a whole schedule step runs in
``test_pipeline.py``'s spawned gloo ranks; here the runner's step is checked with the schedule it
builds stood in for, and what it builds (stage, schedule) is read back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_context import _StandInHorovod
from torch import nn

from shardfc.parallel import context, pipeline
from shardfc.parallel.collectives import count_comm
from shardfc.parallel.context import DistContext
from shardfc.parallel.pipeline import (
    STAGE_ACTIVATIONS,
    STAGE_GRADIENTS,
    PipelineLayout,
    PipelineRunner,
    activation_specs,
    average_gradients_,
    chained_activation_specs,
    check_stage_count,
    create_layout,
    gather_object_to,
    replicas_for,
)
from thread_world import TorchThreadWorld

CPU = torch.device("cpu")


def test_create_layout_places_the_ranks_stage_major_with_their_two_groups():
    stages, replicas = 3, 2

    def rank(r):
        world = DistContext.resolve()
        layout = create_layout(world, stages, 4)
        # each context's collectives run over its own group: sum the world ranks in it
        in_pipe = torch.tensor([float(r)])
        layout.pipe_ctx.all_reduce_(in_pipe)
        in_replica = torch.tensor([float(r)])
        layout.replica_ctx.all_reduce_(in_replica)
        return dict(
            stage=layout.stage, replica=layout.replica, stages=layout.stages, replicas=layout.replicas,
            pipe=dist.get_process_group_ranks(layout.pipe_group), first=layout.is_first, last=layout.is_last,
            pipe_ctx=(layout.pipe_ctx.rank, layout.pipe_ctx.world_size, layout.pipe_ctx.group is layout.pipe_group),
            replica_ctx=(layout.replica_ctx.rank, layout.replica_ctx.world_size),
            replica_group=dist.get_process_group_ranks(layout.replica_ctx.group),
            sums=(in_pipe.item(), in_replica.item()),
            rank_of=[[layout.rank_of(s, j) for j in range(replicas)] for s in range(stages)],
        )

    for r, got in enumerate(TorchThreadWorld(stages * replicas).results(rank)):
        s, j = divmod(r, replicas)
        pipe = [k * replicas + j for k in range(stages)]
        rep = [s * replicas + k for k in range(replicas)]
        assert got == dict(
            stage=s, replica=j, stages=stages, replicas=replicas, pipe=pipe, first=s == 0, last=s == stages - 1,
            pipe_ctx=(s, stages, True), replica_ctx=(j, replicas), replica_group=rep,
            sums=(float(sum(pipe)), float(sum(rep))), rank_of=[[0, 1], [2, 3], [4, 5]],
        ), r


def test_the_layouts_contexts_are_on_the_worlds_device():
    def rank(r):
        layout = create_layout(DistContext.resolve(device="meta"), 2)
        return layout.pipe_ctx.device, layout.replica_ctx.device

    meta = torch.device("meta")
    assert TorchThreadWorld(4).results(rank) == [(meta, meta)] * 4


def test_create_layout_refuses_a_sub_group_horovod_and_an_impossible_grid_on_every_rank():
    def sub_group(r):
        group = dist.new_group([0, 1])
        with pytest.raises(ValueError) as e:
            create_layout(DistContext.resolve(group), 2)
        assert str(e.value) == "the pipeline strategy runs over torch's default group; a sub-group was given"
        with pytest.raises(ValueError, match="pipeline_stages=2 but the backbone has 0 split point"):
            create_layout(DistContext.resolve(), 2, 0)
        with pytest.raises(ValueError, match="world size 2 is not divisible by pipeline_stages=3"):
            create_layout(DistContext.resolve(), 3)
        return True

    assert TorchThreadWorld(2).results(sub_group) == [True, True]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(context, "HorovodCommunicator", _StandInHorovod)
        horovod = DistContext(None, 0, 2, True, CPU, _StandInHorovod())
        assert horovod.is_horovod
        with pytest.raises(ValueError) as e:
            create_layout(horovod, 2)
        assert str(e.value) == "the pipeline strategy needs torch.distributed to be initialised (spawn or torchrun)"


def test_replicas_and_stage_counts_are_ints_and_their_errors_name_the_values():
    assert replicas_for(6, 3) == 2 and type(replicas_for(6, 3)) is int
    assert replicas_for(4, 2, 1) == 2 and check_stage_count(3, 2) == 3 and check_stage_count(5) == 5
    with pytest.raises(ValueError, match=r"pipeline_stages=4 but the backbone has 2 split point\(s\), so it can be cut "
                                         r"into at most 3 stages"):
        check_stage_count(4, 2)
    with pytest.raises(ValueError, match="pipeline_stages must be an int >= 1, got 2.0"):
        check_stage_count(2.0)
    with pytest.raises(ValueError, match=r"pipeline_stages must be an int >= 1, got 0"):
        check_stage_count(0)
    with pytest.raises(ValueError, match=r"the ranks form pipeline_stages x replicas; use a multiple of the stage "
                                         r"count \(--nproc\)"):
        replicas_for(5, 2)


def test_gather_object_to_collects_replica_zeros_pipeline_on_the_chosen_stage():
    stages, replicas = 3, 2

    def rank(r):
        layout = create_layout(DistContext.resolve(), stages)
        return [gather_object_to(layout, ("from", r), dst) for dst in range(stages)]

    got = TorchThreadWorld(stages * replicas).results(rank)
    from_replica_0 = [("from", 0), ("from", 2), ("from", 4)]
    for r, per_dst in enumerate(got):
        s, j = divmod(r, replicas)
        for dst, out in enumerate(per_dst):
            assert out == (from_replica_0 if (j == 0 and s == dst) else None), (r, dst)


@pytest.mark.parametrize("size", [2, 3])
def test_average_gradients_is_the_mean_over_the_group_and_keeps_shapes_and_missing_grads(size):
    def rank(r):
        ctx = DistContext.resolve()
        a = nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
        b = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        c = nn.Parameter(torch.zeros(1))  # no gradient on any rank: left None
        d = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        a.grad = torch.arange(6, dtype=torch.float64).view(2, 3) * (r + 1)
        b.grad = torch.full((4,), 2.0 * r, dtype=torch.float64)
        d.grad = torch.tensor([-4.0, 6.0], dtype=torch.float64) * r
        grads_before = (a.grad, b.grad, d.grad)
        average_gradients_([a, c, b, d], ctx)
        assert all(x is y for x, y in zip((a.grad, b.grad, d.grad), grads_before))  # in place
        return a.grad.clone(), b.grad.clone(), c.grad, d.grad.clone()

    mean_r = (size - 1) / 2  # the ranks' mean
    for a, b, c, d in TorchThreadWorld(size).results(rank):
        torch.testing.assert_close(a, torch.arange(6, dtype=torch.float64).view(2, 3) * (mean_r + 1), rtol=0, atol=0)
        torch.testing.assert_close(b, torch.full((4,), 2.0 * mean_r, dtype=torch.float64), rtol=0, atol=0)
        torch.testing.assert_close(d, torch.tensor([-4.0, 6.0], dtype=torch.float64) * mean_r, rtol=0, atol=0)
        assert c is None


def test_average_gradients_of_one_rank_or_of_no_gradient_changes_nothing():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    average_gradients_([p], DistContext())
    assert p.grad.tolist() == [1.0, 2.0, 3.0]

    def rank(r):  # no gradient anywhere: no collective either (a rank that called one would wait alone)
        q = nn.Parameter(torch.zeros(2))
        if r == 0:
            average_gradients_([q], DistContext.resolve())
        return q.grad

    assert TorchThreadWorld(2, timeout=10).results(rank) == [None, None]


class _Recorder(nn.Module):
    """Records the inputs it is given; outputs ``out_features`` columns in ``dtype``."""

    def __init__(self, out_features: int, dtype=torch.float32) -> None:
        super().__init__()
        self.out_features, self.dtype, self.seen = out_features, dtype, []
        self.bn = nn.BatchNorm1d(1)

    def forward(self, x):
        self.seen.append((tuple(x.shape), x.dtype, torch.is_grad_enabled(), self.training))
        self.bn(x[:, :1].float())
        return torch.ones(x.shape[0], self.out_features, dtype=self.dtype)


def test_activation_specs_run_once_in_eval_mode_without_grad_and_restore_each_modules_mode():
    first, second = _Recorder(5), _Recorder(2, torch.float64)
    first.train()
    second.train()
    second.bn.eval()  # a mixed model: each module's own mode comes back
    sample = torch.randn(2, 3)
    specs = activation_specs([first, second], sample)
    assert specs == [((3,), torch.float32), ((5,), torch.float32), ((2,), torch.float64)]
    assert first.seen == [((2, 3), torch.float32, False, False)]
    assert second.seen == [((2, 5), torch.float32, False, False)]
    assert first.training and first.bn.training and second.training and not second.bn.training
    assert first.bn.num_batches_tracked.item() == 0 and second.bn.num_batches_tracked.item() == 0


def test_activation_specs_take_their_dtypes_under_autocast_and_restore_modes_after_a_failure():
    linear = nn.Linear(3, 4)
    specs = activation_specs([linear], torch.randn(2, 3), lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert specs == [((3,), torch.float32), ((4,), torch.bfloat16)]

    class Fails(nn.Module):
        def forward(self, x):
            raise RuntimeError("no")

    fails = Fails().train()
    with pytest.raises(RuntimeError, match="no"):
        activation_specs([fails], torch.randn(2, 3))
    assert fails.training


def test_chained_activation_specs_pass_each_stages_output_spec_on_to_the_next():
    def rank(r):
        layout = create_layout(DistContext.resolve(), 3)
        module = [_Recorder(5), _Recorder(7, torch.float64), _Recorder(2)][layout.stage]
        specs = chained_activation_specs(module, layout, ((4, 3), torch.float16), CPU)
        return specs, module.seen

    want = [((4, 3), torch.float16), ((5,), torch.float32), ((7,), torch.float64), ((2,), torch.float32)]
    got = TorchThreadWorld(6).results(rank)
    for r, (specs, seen) in enumerate(got):
        stage = r // 2
        assert specs == want, r
        # each stage runs its module once on two zero rows of the previous stage's spec
        assert seen == [((2, *want[stage][0]), want[stage][1], False, False)], r


def test_chained_activation_specs_probe_on_the_device_and_under_the_autocast_given():
    class Where(nn.Module):
        def forward(self, x):
            self.seen = x.device
            return x

    def rank(r):
        layout = create_layout(DistContext.resolve(), 2)
        where, linear = Where(), nn.Linear(3, 4, device="meta")
        on_meta = chained_activation_specs(where if layout.stage == 0 else linear, layout, ((3,), torch.float32),
                                           torch.device("meta"))
        autocast = chained_activation_specs(nn.Identity() if layout.stage == 0 else nn.Linear(3, 4), layout,
                                            ((3,), torch.float32), CPU, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        return on_meta, autocast, getattr(where, "seen", None)

    got = TorchThreadWorld(2).results(rank)
    assert got[0][2] == torch.device("meta")
    assert [g[:2] for g in got] == [([((3,), torch.float32), ((3,), torch.float32), ((4,), torch.float32)],
                                     [((3,), torch.float32), ((3,), torch.float32), ((4,), torch.bfloat16)])] * 2


def test_a_failing_stage_is_the_same_error_on_every_rank():
    def rank(r):
        layout = create_layout(DistContext.resolve(), 3)
        module = [_Recorder(5), _Recorder(6, torch.float64), nn.Linear(3, 2)][layout.stage]
        with pytest.raises(RuntimeError) as e:
            chained_activation_specs(module, layout, ((4,), torch.float32), CPU)
        return str(e.value)

    for msg in TorchThreadWorld(3).results(rank):
        assert msg.startswith("pipeline stage 2 fails on an input of shape [2, 6] (torch.float64): RuntimeError: mat1 "
                              "and mat2 "), msg


def _alone(fn):
    """``fn()`` in a world of one thread rank: a runner's stage needs a default process group."""
    return TorchThreadWorld(1).results(lambda r: fn())[0]


class _Schedule:
    """Stands in for the schedule a runner built: records how its step is called."""

    def __init__(self, losses=()):
        self.calls, self.losses = [], losses

    def step(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if "losses" in kwargs:
            kwargs["losses"].extend(self.losses)


def _runner(stage: int, stages: int = 3, *, module=None, micro: int = 2, local: int = 4, schedule: str = "gpipe",
            allow: bool = False, loss_fn=None) -> PipelineRunner:
    layout = PipelineLayout(stages, 1, stage, 0, None, DistContext(), DistContext())
    spec = ((3,), torch.float32)
    if loss_fn is None and stage == stages - 1:
        loss_fn = lambda e, y: e.sum()  # noqa: E731
    return PipelineRunner(module if module is not None else nn.Linear(3, 3), layout, CPU, schedule=schedule,
                          micro_batches=micro, local_batch=local, specs=(spec, spec), loss_fn=loss_fn,
                          allow_micro_batch_stats=allow)


def test_the_runners_step_feeds_images_to_the_first_stage_labels_to_the_last_and_nothing_between():
    def body():
        images, labels = torch.randn(4, 3), torch.arange(4)
        first, middle, last = _runner(0), _runner(1), _runner(2)
        first.schedule, middle.schedule = _Schedule(), _Schedule()
        last.schedule = _Schedule(losses=[torch.tensor(1.5, requires_grad=True), torch.tensor(2.0)])
        assert first.step(images, labels) is None
        assert first.schedule.calls == [((images,), {})]
        assert middle.step(None, None) is None and middle.schedule.calls == [((), {})]
        loss = last.step(images, labels)
        (args, kwargs), = last.schedule.calls
        assert args == () and kwargs["target"] is labels and kwargs["return_outputs"] is False
        assert loss.item() == 3.5 and not loss.requires_grad  # the micro-batches' losses summed, detached

    _alone(body)


def test_the_runner_refuses_a_batch_of_another_size_and_batch_statistics_over_micro_batches():
    def body():
        for stage, images, labels in [(0, torch.randn(5, 3), None), (2, None, torch.arange(5))]:
            runner = _runner(stage)
            runner.schedule = _Schedule()
            with pytest.raises(ValueError, match=r"pipeline: a local batch of 5 rows, but the schedule was built for "
                                                 r"local_batch=4 \(micro-batches have a fixed shape"):
                runner.step(images, labels)
            assert runner.schedule.calls == []
        def bn():
            return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).train()

        with pytest.raises(RuntimeError) as e:
            _runner(1, module=bn()).step(None, None)
        assert str(e.value) == (
            "pipeline: BatchNorm1d '1' normalises with batch statistics, and micro_batches=2 would normalise each "
            "micro-batch on its own, unlike an unpipelined step; opt in with allow_micro_batch_stats "
            "(--micro-batch-stats: the semantics of gradient accumulation over micro-batches), use micro_batches=1, "
            "or eval-mode BatchNorm")
        for runner in (_runner(1, module=bn(), micro=1), _runner(1, module=bn(), allow=True),
                       _runner(1, module=bn().eval())):
            runner.schedule = _Schedule()
            runner.step(None, None)  # one micro-batch, opted in, or running statistics: the step runs
            assert runner.schedule.calls == [((), {})]

    _alone(body)


def test_the_runner_builds_the_stage_and_schedule_asked_for():
    def body():
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        def loss_fn(e, y):
            return e.sum()

        for schedule, kind in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
            for stage in (0, 1, 2):
                module = nn.Linear(3, 3)
                runner = _runner(stage, module=module, micro=3, local=6, schedule=schedule,
                                 loss_fn=loss_fn if stage == 2 else None)
                assert type(runner.schedule) is kind
                assert (runner.micro_batches, runner.local_batch, runner.module, runner.layout.stage) == (3, 6, module, stage)
                built = runner.schedule._stage
                assert (built.submod, built.stage_index, built.num_stages, built.device) == (module, stage, 3, CPU)
                assert runner.schedule._n_microbatches == 3
                assert runner.schedule._loss_fn is (loss_fn if stage == 2 else pipeline._no_loss_here)
                assert runner.schedule.scale_grads is False

    _alone(body)


def test_the_runner_refuses_bad_settings_naming_them():
    def body():
        layout = PipelineLayout(2, 1, 1, 0, None, DistContext(), DistContext())
        spec = ((3,), torch.float32)
        with pytest.raises(ValueError) as e:
            PipelineRunner(nn.Identity(), layout, CPU, schedule="gpipe", micro_batches=1, local_batch=2, specs=(spec, spec))
        assert str(e.value) == "the last stage needs a loss_fn"
        by_default = PipelineRunner(nn.Identity(), layout, CPU, schedule="gpipe", micro_batches=1, local_batch=2,
                                    specs=(spec, spec), loss_fn=lambda e, y: e.sum())
        assert by_default.allow_micro_batch_stats is False
        with pytest.raises(ValueError, match="micro_batches must be a positive integer, got 0"):
            _runner(0, micro=0)
        with pytest.raises(ValueError, match="local_batch must be a positive integer, got 0"):
            _runner(0, local=0)
        with pytest.raises(ValueError, match=r"not divisible by micro_batches=4: pipeline micro-batches have a fixed shape "
                                             r"\(choose a batch size that is a multiple of it\)"):
            _runner(0, micro=4, local=6)
        _runner(0, stages=3, micro=3, local=3, schedule="1f1b")  # as many micro-batches as stages: allowed
        _runner(0, stages=3, micro=2, local=4, schedule="gpipe")  # gpipe takes fewer
        with pytest.raises(ValueError, match="micro_batches >= pipeline_stages, got micro_batches=2 for 3 stages"):
            _runner(0, stages=3, micro=2, local=4, schedule="1f1b")
        assert _runner(0).allow_micro_batch_stats is False and _runner(0, allow=1).allow_micro_batch_stats is True
        with pytest.raises(RuntimeError) as e:
            pipeline._no_loss_here(torch.zeros(1), torch.zeros(1))
        assert str(e.value) == "the loss is computed on the last pipeline stage only"

    _alone(body)


class _Op:
    def __init__(self, op, numel: int, dtype=torch.float32):
        self.op, self.tensor = op, torch.zeros(numel, dtype=dtype)


class _StandInStage:
    def __init__(self):
        self.fwd = [_Op(dist.isend, 6), _Op(dist.irecv, 100), _Op(dist.isend, 2, torch.float64)]
        self.bwd = [_Op(dist.isend, 5, torch.float16)]

    def get_fwd_send_ops(self, chunk):
        return self.fwd if chunk == 0 else []

    def get_bwd_send_ops(self, chunk):
        return self.bwd


def test_the_stages_sends_are_counted_by_kind_where_they_are_sent():
    stage = _StandInStage()
    pipeline._count_sends(stage)
    with count_comm() as counter:
        assert stage.get_fwd_send_ops(0) is stage.fwd  # the ops handed on unchanged
        assert stage.get_fwd_send_ops(1) == []  # nothing sent: no call counted
        assert stage.get_bwd_send_ops(0) is stage.bwd
        stage.get_bwd_send_ops(1)
    # sends only (a receive is counted by its sender): 6 x 4 + 2 x 8 bytes forward, 5 x 2 twice backward
    assert counter.bytes == {STAGE_ACTIVATIONS: 40, STAGE_GRADIENTS: 20}
    assert counter.calls == {STAGE_ACTIVATIONS: 1, STAGE_GRADIENTS: 2}


def test_the_runners_stage_talks_over_its_replicas_pipeline_group():
    def rank(r):
        layout = create_layout(DistContext.resolve(), 2)
        spec = ((3,), torch.float32)
        runner = PipelineRunner(nn.Linear(3, 3), layout, CPU, schedule="gpipe", micro_batches=1, local_batch=2,
                                specs=(spec, spec), loss_fn=(lambda e, y: e.sum()) if layout.is_last else None)
        built = runner.schedule._stage
        return built.group is layout.pipe_group, built.group_rank, built.stage_index

    assert TorchThreadWorld(4).results(rank) == [(True, 0, 0), (True, 0, 0), (True, 1, 1), (True, 1, 1)]
