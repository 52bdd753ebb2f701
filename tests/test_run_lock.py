"""One run per output folder (eva_fastclip/reliability/run_lock.py) and what the launch supervisor makes of
it (reliability/supervisor.py), with real processes: a live holder refuses a second run, naming its host and
pid; a SIGKILLed one, a reused pid and a silent host are taken over; the exit code a run records is what the
supervisor returns when a signal ended DeepSpeed's runner first; and the supervisor returns only after the
processes its command left behind. Real launches: tests/launched/test_straggler_runs.py (a second run on a
live run's folder), test_resume_runs.py (a SIGKILLed run's folder resumed), test_preemption.py and
test_multi_node.py (the supervisor under a scheduler's signals)."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from launching import REPO, launcher_env
from restart_stand_in import stand_in

from eva_fastclip.reliability import run_lock, supervisor
from eva_fastclip.reliability.run_lock import FolderHeld, RunLock


def hold(folder) -> subprocess.Popen:
    """Another process that takes ``folder`` and keeps it (a live run's rank 0)."""
    script = (
        "import sys, time\n"
        "from eva_fastclip.reliability.run_lock import RunLock\n"
        "RunLock(sys.argv[1]).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_run_holds_its_folder_until_it_is_killed(tmp_path, caplog):
    holder = hold(tmp_path)
    try:
        with pytest.raises(FolderHeld) as refused:
            RunLock(tmp_path).acquire()
        host = socket.gethostname()
        assert f"is held by a live run (host {host}, pid {holder.pid}, since " in str(refused.value)
        assert "\n" not in str(refused.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    killed = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=run_lock.__name__):
        RunLock(tmp_path).acquire()
    print(f"the SIGKILLed holder's lock taken over {time.monotonic() - killed:.3f} s after its death")
    assert (
        f"(host {host}, pid {holder.pid}, since" in caplog.text and f"pid {holder.pid} is gone" in caplog.text
    )
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()


def take(folder) -> None:
    """Take ``folder`` and give it up (its heartbeat stops, and cannot overwrite the next lock written)."""
    lock = RunLock(folder)
    lock.acquire()
    lock.release(0)


def test_a_reused_pid_and_a_silent_host_are_stale(tmp_path, caplog, monkeypatch):
    """The pid of a live process (this one) with another start time is not the holder. A lock from another
    host (a replacement pod, a requeued job on another node) is held while its beat count advances, stale
    once it stops for WATCH_S (3 s here)."""
    monkeypatch.setattr(run_lock, "WATCH_S", 3.0)
    lock = tmp_path / "run.lock"
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "process_start": 1}
    lock.write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger=run_lock.__name__):
        take(tmp_path)
    assert f"pid {os.getpid()} is another process now" in caplog.text

    elsewhere = {**record, "host": "node-17", "beat": 0}
    lock.write_text(json.dumps(elsewhere))
    beating = threading.Event()

    def beat():  # node-17's holder, alive: a beat a second
        while not beating.wait(1.0):
            elsewhere["beat"] += 1
            lock.write_text(json.dumps(elsewhere))

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        with pytest.raises(FolderHeld, match="host node-17"):
            take(tmp_path)
    finally:
        beating.set()
        beater.join()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=run_lock.__name__):
        take(tmp_path)  # node-17 died: no beat in 3 s
    assert "no heartbeat from node-17 in 3 s" in caplog.text and time.monotonic() - started >= 3


def dead_pid() -> int:
    """A pid no process has now (one that just ended and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def beat_for(lock, record: dict, seconds: float, times_off_by: float) -> threading.Thread:
    """Another host's holder, alive for ``seconds``: a beat every 0.5 s, its file's times (a file server's
    clock) and its ``started`` (its host's clock) off from this host's by ``times_off_by`` seconds."""
    record["started"] = time.time() + times_off_by

    def beat():
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            record["beat"] = record.get("beat", 0) + 1
            lock.write_text(json.dumps(record))
            skewed = time.time() + times_off_by
            os.utime(lock, (skewed, skewed))
            time.sleep(0.5)

    thread = threading.Thread(target=beat)
    thread.start()
    return thread


@pytest.mark.parametrize("off_by", [-3600.0, 3600.0], ids=["times-an-hour-behind", "times-an-hour-ahead"])
def test_no_clock_decides_whether_a_lock_lives(tmp_path, caplog, monkeypatch, off_by):
    """Locks whose file times and start time are an hour off this host's clock: one from another host is
    held while its beat count moves and taken over once it stands still for WATCH_S; one from a container
    that shares this host's name but not its PID namespace (``hostNetwork`` pods), its pid dead here, is
    judged by its beat too, not by a pid this process cannot see."""
    monkeypatch.setattr(run_lock, "WATCH_S", 3.0)
    lock = tmp_path / "run.lock"
    elsewhere = {"host": "node-17", "pid": 4242, "process_start": 1, "place": "another-boot/pid:[1]"}
    neighbour = {**elsewhere, "host": socket.gethostname(), "pid": dead_pid()}
    for record in (elsewhere, neighbour):
        beater = beat_for(lock, record, 4.0, off_by)
        time.sleep(0.2)
        try:
            with pytest.raises(FolderHeld, match=f"host {record['host']}, pid {record['pid']}"):
                take(tmp_path)
        finally:
            beater.join()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=run_lock.__name__):
            take(tmp_path)  # its beats stopped
        took = time.monotonic() - started
        print(f"{record['host']}'s silent lock taken over {took:.1f} s after the watch began")
        assert f"no heartbeat from {record['host']} in 3 s" in caplog.text and took >= 3
        caplog.clear()


def test_other_hosts_ranks_live_while_their_counts_move(tmp_path, monkeypatch):
    """The supervisor's view of a rank on another host (running_ranks with one BeatWatch across reads):
    present while its beat count moves, whatever its clock says (an hour ahead), gone once the count
    stood still for the watch's patience (1 s here), present again when it beats."""
    folder = tmp_path / "run.lock.ranks"
    folder.mkdir()
    mark = folder / "rank_1.json"
    record = {"host": "node-17", "pid": 7, "started": time.time() + 3600, "process_start": 1, "beat": 0}
    mark.write_text(json.dumps(record))
    watch = run_lock.BeatWatch(patience=1.0)
    assert [r.host for r in run_lock.running_ranks(tmp_path, watch)] == ["node-17"]
    time.sleep(1.3)
    assert run_lock.running_ranks(tmp_path, watch) == []
    mark.write_text(json.dumps({**record, "beat": 1}))
    assert [r.beat for r in run_lock.running_ranks(tmp_path, watch)] == [1]


def test_release_records_the_exit_and_gives_the_folder_up(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.join(0)
    watch = run_lock.BeatWatch()
    assert [rank.pid for rank in run_lock.running_ranks(tmp_path, watch)] == [os.getpid()]
    lock.release(75, "step 7: SIGTERM")
    ended = json.loads((tmp_path / "run_exit.json").read_text())
    assert {k: ended[k] for k in ("code", "detail", "pid")} == {
        "code": 75,
        "detail": "step 7: SIGTERM",
        "pid": os.getpid(),
    }
    assert not (tmp_path / "run.lock").exists()
    # marked leaving, but this process still runs on this host: the supervisor waits for its end
    assert [rank.left for rank in run_lock.running_ranks(tmp_path, watch)] == [True]


def test_the_supervisor_refuses_a_held_folder_before_it_launches(tmp_path, capfd):
    command = stand_in(tmp_path, [0])
    holder = hold(tmp_path / "run")  # the stand-in's train.output_dir
    try:
        capfd.readouterr()
        code = supervisor.main(["--", *command])
    finally:
        holder.kill()
        holder.wait()
    err = capfd.readouterr().err
    assert code == 2 and not (tmp_path / "calls.jsonl").exists()
    assert f"is held by a live run (host {socket.gethostname()}, pid {holder.pid}" in err


def test_the_supervisor_leaves_a_lock_from_another_host_to_rank_0(tmp_path, capfd):
    """A fresh lock from another host may be a dead pod's (a replacement pod has another hostname): the
    supervisor launches, and rank 0 watches its heartbeat (acquire()) before it refuses or takes over."""
    command = stand_in(tmp_path, [0])
    (tmp_path / "run").mkdir()
    record = {"host": "node-17", "pid": 1, "started": time.time(), "process_start": None}
    (tmp_path / "run" / "run.lock").write_text(json.dumps(record))
    assert supervisor.main(["--", *command]) == 0 and (tmp_path / "calls.jsonl").exists()


def test_the_runs_own_code_when_a_signal_ended_the_runner(tmp_path, capfd):
    """A runner killed by SIGUSR1 (138) after its ranks recorded 75 (SLURM's --signal without B:): 75,
    though rank 0's host clock, which timed the record, is an hour behind. A second launch killed the
    same way before its ranks recorded anything: 138, though the first launch's record is there with a
    time an hour ahead."""
    out = tmp_path / "run"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"train": {"output_dir": str(out)}}))
    runner = tmp_path / "runner.py"
    runner.write_text(
        textwrap.dedent(f"""
        import json, os, signal, sys, time
        from pathlib import Path
        from eva_fastclip.reliability.run_lock import RunLock
        if sys.argv[1] == "record":
            lock = RunLock({str(out)!r})
            lock.acquire()
            lock.release(75, "preempted")
            exit_file = Path({str(out)!r}) / "run_exit.json"
            record = json.loads(exit_file.read_text())
            exit_file.write_text(json.dumps({{**record, "ended": time.time() - 3600}}))
        os.kill(os.getpid(), signal.SIGUSR1)
        """)
    )
    capfd.readouterr()
    command = [sys.executable, str(runner), "record", "train", "--config", str(config)]
    code = supervisor.main(["--", *command])
    err = capfd.readouterr().err
    assert code == 75, err
    assert "the runner ended with 138 (killed by signal SIGUSR1); the run itself with 75" in err
    exit_file = out / "run_exit.json"
    exit_file.write_text(json.dumps({**json.loads(exit_file.read_text()), "ended": time.time() + 3600}))
    command[2] = "silent"
    assert supervisor.main(["--", *command]) == 138, capfd.readouterr().err


def test_the_supervisor_waits_for_a_rank_on_a_host_whose_clock_is_behind(tmp_path, capfd):
    """A rank on node-17, whose clock is an hour behind, still saving when the runner returns: the
    supervisor waits until its mark says it left (2 s of beats), though the mark's start time is long
    before the launch's by this host's clock."""
    out = tmp_path / "run"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"train": {"output_dir": str(out)}}))
    mark = out / "run.lock.ranks" / "rank_1.json"
    record = {"host": "node-17", "pid": 7, "started": time.time() - 3600, "process_start": 1, "beat": 0}
    runner = (
        f"import pathlib, sys; p = pathlib.Path({str(mark)!r}); p.parent.mkdir(parents=True); "
        "p.write_text(sys.argv[1])"
    )

    def node_17():  # beats once the launch made its mark, then leaves
        while not mark.exists():
            time.sleep(0.05)
        beat_for(mark, record, 2.0, -3600).join()
        mark.write_text(json.dumps({**record, "left": True}))

    remote = threading.Thread(target=node_17)
    remote.start()
    started = time.monotonic()
    command = [sys.executable, "-c", runner, json.dumps(record), "train", "--config", str(config)]
    code = supervisor.main(["--", *command])
    took = time.monotonic() - started
    remote.join()
    print(f"the supervisor returned {took:.1f} s after the launch, once node-17's rank had left")
    assert code == 0 and took >= 2, capfd.readouterr().err


def test_the_supervisor_returns_after_the_processes_its_command_left(tmp_path):
    """The command exits at once, leaving a process that ends 2 s later (launch.py and the ranks after
    DeepSpeed's runner returned): the supervisor, their subreaper, returns after it, with the command's
    code."""
    done = tmp_path / "done"
    orphan = f"(sleep 2; touch {done}) & exit 3"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "eva_fastclip.reliability.supervisor", "--", "bash", "-c", orphan],
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - started
    print(f"the supervisor returned {took:.1f} s after its start, its command's orphan having ended")
    assert result.returncode == 3, result.stderr
    assert done.exists() and took >= 2
