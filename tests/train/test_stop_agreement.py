"""The per-step stop agreement without a host sync (CUDA's lagged form, run here on gloo)."""

from __future__ import annotations

import signal

from shardfc.parallel import lifecycle
from shardfc.parallel.context import DistContext
from shardfc.parallel.launch import spawn
from shardfc.train.stopping import StopAgreement


def _checks(rank: int, world: int, signalled_rank: int) -> tuple:
    ctx = DistContext.resolve()
    plain, lagged = StopAgreement(ctx, lagged=False), StopAgreement(ctx, lagged=True)
    seen_plain, seen_lagged = [plain()], [lagged()]
    if rank == signalled_rank:
        lifecycle._record(signal.SIGTERM)
    seen_plain.append(plain())
    seen_lagged += [lagged(), lagged()]
    return seen_plain, seen_lagged


def test_the_lagged_agreement_stops_every_rank_one_step_later():
    # Unlagged: the check after the signal sees it. Lagged: the check after that, on every rank alike.
    assert spawn(_checks, 2, 1) == [([0, signal.SIGTERM], [0, 0, signal.SIGTERM])] * 2


def test_the_agreement_is_lagged_only_on_a_cuda_communicator():
    assert StopAgreement(DistContext()).lagged is False  # no communicator: the CPU
    try:
        lifecycle._record(signal.SIGINT)
        assert StopAgreement(DistContext())() == signal.SIGINT
    finally:
        lifecycle._reset_for_tests()
