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


# ---------------------------------------------------------------- ranks as threads (mutmut sees them)


def _thread_checks(monkeypatch, world: int, signals: dict, lagged: bool) -> list:
    """Each thread rank checks 3 times; rank r has recorded ``signals[r][i]`` at its i-th check.
    The recorded signal is per process, so each thread gets its own through a stand-in."""
    import threading

    from shardfc.train import stopping
    from thread_world import ThreadWorld

    mine = threading.local()
    monkeypatch.setattr(stopping, "received_signal", lambda: mine.signal)
    tw = ThreadWorld(world)

    def rank_fn(rank):
        agreement = StopAgreement(tw.context(), lagged=lagged)
        seen = []
        for i in range(3):
            mine.signal = signals.get(rank, [None] * 3)[i]
            seen.append(agreement())
        return agreement.lagged, seen

    return tw.results(rank_fn)


def test_every_thread_rank_sees_the_largest_signal_at_the_check_it_was_recorded(monkeypatch):
    signals = {1: [None, signal.SIGINT, signal.SIGINT], 2: [None, None, signal.SIGTERM]}
    out = _thread_checks(monkeypatch, 3, signals, lagged=False)
    assert out == [(False, [0, signal.SIGINT, max(signal.SIGINT, signal.SIGTERM)])] * 3


def test_every_thread_rank_sees_the_lagged_agreement_one_check_later(monkeypatch):
    signals = {0: [None, signal.SIGTERM, signal.SIGTERM]}
    assert _thread_checks(monkeypatch, 2, signals, lagged=True) == [(True, [0, 0, signal.SIGTERM])] * 2
    # two ranks signalled at once: the largest number, not their sum
    signals = {0: [signal.SIGINT] * 3, 2: [signal.SIGTERM] * 3}
    both = max(signal.SIGINT, signal.SIGTERM)
    assert _thread_checks(monkeypatch, 3, signals, lagged=True) == [(True, [0, both, both])] * 3


def test_no_signal_agrees_on_zero_and_lagged_by_default_only_on_cuda(monkeypatch):
    assert _thread_checks(monkeypatch, 2, {}, lagged=False) == [(False, [0, 0, 0])] * 2
    assert _thread_checks(monkeypatch, 2, {}, lagged=None) == [(False, [0, 0, 0])] * 2  # a CPU communicator


def test_one_process_agrees_on_zero_without_a_signal():
    from shardfc.train.stopping import agreed_stop_signal

    assert agreed_stop_signal(DistContext()) == 0 and StopAgreement(DistContext())() == 0


def test_one_process_asked_to_lag_reads_its_own_signal_one_check_later():
    agreement = StopAgreement(DistContext(), lagged=True)
    try:
        assert agreement() == 0
        lifecycle._record(signal.SIGTERM)
        assert agreement() == 0  # lagged: the agreement launched at the previous check
        assert agreement() == signal.SIGTERM
    finally:
        lifecycle._reset_for_tests()


# ---------------------------------------------------------------- the test-only crash


def test_crash_if_asked_ends_that_rank_at_that_step_once(monkeypatch, tmp_path):
    from shardfc.train import stopping

    exits = []
    monkeypatch.setattr(stopping.os, "_exit", lambda code: exits.append(code))
    marker = tmp_path / "crashed:at 3"  # the marker's path may hold the separator
    monkeypatch.delenv(stopping.CRASH_ENV, raising=False)
    stopping.crash_if_asked(1, 3)  # not asked
    monkeypatch.setenv(stopping.CRASH_ENV, f"1:3:{marker}")
    for rank, step in ((0, 3), (1, 2), (1, 4)):  # another rank, another step
        stopping.crash_if_asked(rank, step)
    assert exits == [] and not marker.exists()
    stopping.crash_if_asked(1, 3)
    assert exits == [1] and marker.read_text(encoding="utf-8") == "rank 1 crashed at step 3\n"
    stopping.crash_if_asked(1, 3)  # after the restart: the marker stops a second crash
    assert exits == [1]
