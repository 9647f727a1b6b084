"""Process-group plumbing: collectives as autograd functions, comm accounting, launch helpers."""

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

__all__ = [
    "CommCounter",
    "all_gather_rows",
    "all_reduce",
    "comm_device",
    "count_comm",
    "gather_rows_forward_reduce_scatter_backward",
    "group_rank",
    "group_size",
    "reduce_scatter_rows",
]
