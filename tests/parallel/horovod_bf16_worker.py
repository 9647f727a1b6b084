"""Run under ``horovodrun -np 2``: HorovodCommunicator's collectives on bf16 tensors, checked exactly.

Every rank builds every rank's inputs from the same seed, so it knows the right answer: the gather
is exact, and a sum of two bf16 values is exact in fp32, so the reduced rows must equal the float64
sum rounded once to bf16. Writes ``rank<R>.json`` into the folder given as the first argument.
"""

import json
import sys
from pathlib import Path

import torch

from shardfc.parallel.collectives import count_comm
from shardfc.parallel.comm import HorovodCommunicator

comm = HorovodCommunicator()
rank, world = comm.rank, comm.world_size
assert world == 2, world
gen = torch.Generator().manual_seed(7)
sizes = [3, 2]  # unequal: the gather pads nothing, the reduce-scatter takes the all-reduce path
rows = [torch.randn(s, 5, generator=gen).to(torch.bfloat16) for s in sizes]
full = [torch.randn(sum(sizes), 5, generator=gen).to(torch.bfloat16) for _ in range(world)]
even = [torch.randn(4, 5, generator=gen).to(torch.bfloat16) for _ in range(world)]
flags = [torch.randn(6, generator=gen).to(torch.bfloat16) for _ in range(world)]

with count_comm() as counter:
    gathered = comm.all_gather_rows(rows[rank], sizes)
    scattered = comm.reduce_scatter_rows(full[rank], sizes)
    scattered_even = comm.reduce_scatter_rows(even[rank], [2, 2])
    mine = flags[rank].clone()
    comm.all_reduce_(mine[2:], op="max")  # a view, as the trainer's overflow flags are

assert gathered.dtype == torch.bfloat16 and torch.equal(gathered, torch.cat(rows))
lo = sum(sizes[:rank])
want = (full[0].double() + full[1].double()).to(torch.bfloat16)[lo : lo + sizes[rank]]
assert scattered.dtype == torch.bfloat16 and torch.equal(scattered, want), (scattered, want)
want_even = (even[0].double() + even[1].double()).to(torch.bfloat16)[2 * rank : 2 * rank + 2]
assert torch.equal(scattered_even, want_even)
assert torch.equal(mine[:2], flags[rank][:2]) and torch.equal(mine[2:], torch.maximum(flags[0], flags[1])[2:])
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(counter.bytes))
