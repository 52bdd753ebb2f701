"""Whom a hang report names (reliability/watchdog.py), judged by heartbeat counts that move, read twice by
this host's clock, against a real TCPStore: a rank beating is current, one whose count stopped is stopped
or gone, one that never beat is named as that (its missing key no longer stalls the read into "the store
on rank 0 does not answer"), and no host's clock enters the verdict. The launched runs (a SIGSTOPped rank,
a stalled loader worker): tests/launched/test_hang_watchdog.py."""

import threading
import time

import pytest
from torch.distributed import TCPStore

from eva_fastclip.reliability import watchdog as watchdog_module
from eva_fastclip.reliability.watchdog import Watchdog


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield "127.0.0.1", server.port
    del server


def rank(store, number: int, step: int = 5, world: int = 4) -> Watchdog:
    dog = Watchdog(600, 600, rank=number, world_size=world)  # no thread: the test beats for it
    dog._store_address = store
    dog.step = step
    dog.set_phase("backward (and its gradient reduction)")
    return dog


def beat_until(dog: Watchdog, done: threading.Event, phase: str) -> threading.Thread:
    """A thread that beats for ``dog`` every 0.2 s until ``done`` (a live rank's watchdog)."""

    def run():
        while not done.wait(0.2):
            dog._beat(phase, 1.0)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_report_names_the_stopped_rank_and_the_one_that_never_beat(store, monkeypatch):
    monkeypatch.setattr(watchdog_module, "PEER_WATCH_S", 1.0)  # the interval between the two reads
    me, alive, stopped = rank(store, 0), rank(store, 1), rank(store, 3)  # rank 2 never beats
    stopped._beat("backward (and its gradient reduction)", 3.0)  # one beat, then nothing: SIGSTOPped
    beating = threading.Event()
    thread = beat_until(alive, beating, "backward (and its gradient reduction)")
    try:
        time.sleep(0.5)
        started = time.monotonic()
        report = me._peers()
        took = time.monotonic() - started
    finally:
        beating.set()
        thread.join()
    print(f"the report read the heartbeats twice in {took:.1f} s")
    assert "does not answer" not in report, report  # rank 0 is not blamed for rank 2's missing key
    assert "no heartbeat in 1 s (stopped or gone): rank 3 (" in report
    assert "no heartbeat ever (never started, or stopped before its first): ranks [2]" in report
    assert "rank 1 (" not in report  # beating, same step and phase: current
    assert took < 3.0


def test_a_rank_behind_is_named_whatever_its_hosts_clock_says(store, monkeypatch):
    """A heartbeat carries no time: a host whose clock is minutes off cannot make a live rank look stale
    or a dead one live; only its count moving does."""
    monkeypatch.setattr(watchdog_module, "PEER_WATCH_S", 0.6)
    monkeypatch.setattr(watchdog_module.time, "time", lambda: 0.0)  # every clock here reads 1970
    me, behind = rank(store, 0, world=2), rank(store, 1, step=4, world=2)
    beating = threading.Event()
    thread = threading.Thread(
        target=lambda: [behind._beat("loader", 1.0) for _ in iter(lambda: beating.wait(0.1), True)]
    )
    thread.start()
    try:
        time.sleep(0.3)
        report = me._peers()
    finally:
        beating.set()
        thread.join()
    assert "behind, at an earlier step: rank 1 (" in report and "step 4, loader" in report
    assert "stopped or gone" not in report
