"""Data movement and process placement.

    context.py      DistContext: group, rank, world size, device and communicator, resolved once at the boundary
    comm.py         Communicator: the head's and trainer's collectives over torch.distributed or Horovod
    collectives.py  every torch.distributed collective as a counted function, and the head's gather/reduce-scatter mapping
    counting.py     count_comm: the bytes and calls of every collective in a block, recorded by both of the above
    launch.py       spawn N local processes, or join a torchrun (env://) group
    torchrun.py     the ``shardfc torchrun`` wrapper
    lifecycle.py    processes that live and die together: signals recorded and forwarded, parent-death watch
    partition.py    counts and costs divided into parts (classes and rows over ranks, stages of a backbone)
    model_split.py  a backbone cut at named split points over devices (SplitModel), and micro-batch pipelining
    stage_build.py  one pipeline stage built alone with the whole model's initialisation
    pipeline.py     the stages x replicas layout, its groups, one stage's torch.distributed.pipelining schedule
    pipeline_forward.py  forward only through the stages (evaluation)
    split_bench.py  time one device vs split vs pipelined (for shardfc bench)
"""

from shardfc.parallel.collectives import (
    CommCounter,
    all_gather_rows,
    all_reduce,
    comm_device,
    count_comm,
    gather_rows_forward_reduce_scatter_backward,
    group_rank,
    group_size,
    reduce_scatter_rows,
)
from shardfc.parallel.comm import Communicator, HorovodCommunicator, TorchDistCommunicator
from shardfc.parallel.context import DistContext

__all__ = [
    "CommCounter",
    "Communicator",
    "DistContext",
    "HorovodCommunicator",
    "TorchDistCommunicator",
    "all_gather_rows",
    "all_reduce",
    "comm_device",
    "count_comm",
    "gather_rows_forward_reduce_scatter_backward",
    "group_rank",
    "group_size",
    "reduce_scatter_rows",
]
