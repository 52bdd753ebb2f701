"""Preemption with real processes and real signals (reliability/preemption.py): a signal to one rank, to every
rank or to the ``deepspeed`` launcher makes every rank save the checkpoint of the step in flight and exit
with code 75; the run resumes from it exactly; a second signal stops at once, the last complete checkpoint
intact. Each test prints how long the stop took, from the signal to the last process of the run gone.

Two ranks through the real launcher, tiny model, fp32 on CPU, 2 loader workers a rank (they ignore the
signals: the step in flight finishes), 16 pairs a step, no scheduled saves unless a test asks for them.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from launching import REPO, free_port, launcher_env

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.export import consolidated_state_dict
from eva_fastclip.reliability.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.launcher

STEPS, SIGNAL_AFTER = 30, 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption_data")
    write_toy_dataset(root, num_train=64, num_val=8, num_zeroshot=8, image_size=32, samples_per_shard=16)
    return root


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [
        "model.name=test-vit-xs",
        "model.patch_dropout=0.5",
        "loss.name=fastclip_v3",
        f'data.train_shards=["{data / "train"}"]',
        "data.workers=2",
        "data.shuffle_buffer=10",
        "eval.zeroshot_dir=null",
        "eval.retrieval_shards=null",
        "train.precision=fp32",
        "train.batch_size=8",
        f"train.steps={STEPS}",
        "train.log_every_steps=1",
        f"train.output_dir={out}",
        "optim.warmup_steps=2",
        *extra,
    ]
    return ["train", "--config", "configs/toy.json", *(x for s in sets for x in ("--set", s))]


class Run:
    """``deepspeed --num_gpus 2 --module eva_fastclip ARGS`` in a session of its own."""

    def __init__(self, args: list[str], log: Path, preexec_fn=None) -> None:
        deepspeed = str(Path(sys.executable).parent / "deepspeed")
        self.log = log
        self.out = open(log, "w")  # noqa: SIM115 (closed in wait)
        command = [
            deepspeed,
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "eva_fastclip",
        ]
        self.proc = subprocess.Popen(
            [*command, *args],
            cwd=REPO, env=launcher_env(), stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=preexec_fn,
        )  # fmt: skip
        self.output_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("train.output_dir=")))

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        """Until rank 0 has logged ``step`` (the launch must not end first)."""
        path = self.output_dir / "train_log.jsonl"
        deadline = time.monotonic() + timeout
        while not (path.exists() and len(path.read_text().splitlines()) >= step):
            assert self.proc.poll() is None, f"the run ended first:\n{self.log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "no step logged in time"
            time.sleep(0.05)

    def processes(self) -> list[psutil.Process]:
        """The launcher's and every descendant's processes: launch.py, the ranks, their loader workers."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def rank(self, local_rank: int) -> psutil.Process:
        """The rank's own process: a child of launch.py (its loader workers share its command line)."""
        (launch,) = [p for p in self.processes() if "deepspeed.launcher.launch" in _cmdline(p)]
        (found,) = [p for p in launch.children() if f"--local_rank={local_rank}" in _cmdline(p)]
        return found

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.out.close()

    def text(self) -> str:
        return self.log.read_text()


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # ended meanwhile (a zombie until reaped)
        return []


def all_gone(processes: list[psutil.Process], timeout: float) -> float:
    """Seconds until every process has ended; fails naming those left after ``timeout``."""
    started = time.monotonic()
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, f"left behind: {[(p.pid, _cmdline(p)[-6:]) for p in alive]}"
    return time.monotonic() - started


def last_complete(out: Path) -> int:
    return int(checkpoint.complete_checkpoints(out / "checkpoints")[-1].name.removeprefix("step_"))


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    run = Run(train_args(data, out), out.parent / "whole.log")
    assert run.wait() == 0, run.text()[-4000:]
    return out


def step_log(out: Path) -> list[str]:
    return (out / "train_log.jsonl").read_text().splitlines()


def test_sigterm_to_one_rank_saves_that_step_and_resumes_exactly(data, uninterrupted, tmp_path):
    """SIGTERM to rank 1 alone: both ranks agree at the next step boundary, save that step together and
    exit with 75, and so does the launcher; --resume latest then ends where the uninterrupted run does
    (every step's logged metrics and the final weights and per-sample table equal)."""
    out = tmp_path / "run"
    run = Run(train_args(data, out), tmp_path / "preempted.log")
    run.wait_for_step(SIGNAL_AFTER)
    processes = run.processes()
    signalled = time.monotonic()
    run.rank(1).send_signal(signal.SIGTERM)
    code = run.wait()
    gone = all_gone(processes, timeout=30) + time.monotonic() - signalled
    print(f"SIGTERM to rank 1: every process of the run gone {gone:.1f} s after the signal")
    assert code == PREEMPTED_EXIT_CODE, run.text()[-4000:]
    saved = last_complete(out)
    assert SIGNAL_AFTER < saved < STEPS and len(step_log(out)) == saved
    assert f"eva-fastclip train: preempted: step {saved}: another rank was asked to stop" in run.text()

    resumed = Run([*train_args(data, out), "--resume", "latest"], tmp_path / "resumed.log")
    assert resumed.wait() == 0, resumed.text()[-4000:]
    assert f"resumed from {out / 'checkpoints' / checkpoint.tag_for_step(saved)}" in resumed.text()
    assert step_log(out) == step_log(uninterrupted)  # the same losses, metrics and lrs, step by step
    final = checkpoint.tag_for_step(STEPS)
    want = consolidated_state_dict(uninterrupted / "checkpoints" / final)
    got = consolidated_state_dict(out / "checkpoints" / final)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=0, msg=name)
    for path in (uninterrupted / "checkpoints" / final / "per_sample").iterdir():
        other = out / "checkpoints" / final / "per_sample" / path.name
        torch.testing.assert_close(torch.load(other)["values"], torch.load(path)["values"], rtol=1e-6, atol=0)


def test_sigterm_to_the_deepspeed_launcher_saves_instead_of_training_on_orphaned(data, tmp_path):
    """SIGTERM to the ``deepspeed`` command alone: it exits at once (143), forwarding nothing on one node;
    the ranks see their launcher's parent gone, save the step in flight and exit, and launch.py with them:
    nothing of the run trains on."""
    out = tmp_path / "run"
    run = Run(train_args(data, out), tmp_path / "launcher.log")
    run.wait_for_step(SIGNAL_AFTER)
    processes = run.processes()
    signalled = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30) == -signal.SIGTERM or run.proc.returncode == 128 + signal.SIGTERM
    gone = all_gone(processes, timeout=60) + time.monotonic() - signalled
    print(f"SIGTERM to the deepspeed launcher: every process of the run gone {gone:.1f} s after the signal")
    saved = last_complete(out)
    assert SIGNAL_AFTER < saved < STEPS and len(step_log(out)) == saved


def test_the_preempt_signal_to_every_rank(data, tmp_path):
    """train.preempt_signal=SIGUSR1 (SLURM's --signal=USR1@...) to both ranks: the same stop, exit 75. The
    run also saves every 0.3 s (train.save_every_minutes): rank 0's clock decides, and both ranks save at
    the same steps (a save is a collective: ranks that disagreed would wait for each other for good)."""
    out = tmp_path / "run"
    sets = ["train.preempt_signal=SIGUSR1", "train.save_every_minutes=0.005", "train.keep_checkpoints=100"]
    run = Run(train_args(data, out, *sets), tmp_path / "usr1.log")
    run.wait_for_step(SIGNAL_AFTER)
    processes = run.processes()
    signalled = time.monotonic()
    for local_rank in (0, 1):
        run.rank(local_rank).send_signal(signal.SIGUSR1)
    code = run.wait()
    gone = all_gone(processes, timeout=30) + time.monotonic() - signalled
    print(f"SIGUSR1 to both ranks: every process of the run gone {gone:.1f} s after the signal")
    assert code == PREEMPTED_EXIT_CODE, run.text()[-4000:]
    assert f"eva-fastclip train: preempted: step {last_complete(out)}: SIGUSR1" in run.text()
    assert len(checkpoint.complete_checkpoints(out / "checkpoints")) > 2  # saved by time before the stop


def test_a_second_signal_stops_at_once_with_the_last_checkpoint_intact(data, tmp_path):
    """Rank 1 stopped (SIGSTOP), so rank 0 cannot reach the step boundary: SIGTERM asks rank 0 to stop,
    and a second SIGTERM 3 s later ends it at once although it waits inside a collective; the last
    complete checkpoint (scheduled, step 4) stays the one to resume."""
    out = tmp_path / "run"
    run = Run(train_args(data, out, "train.save_every_steps=4"), tmp_path / "second.log")
    run.wait_for_step(6)
    processes = run.processes()
    rank0, rank1 = run.rank(0), run.rank(1)
    rank1.suspend()
    try:
        time.sleep(1.0)  # rank 0 is in a collective with rank 1 by now
        rank0.send_signal(signal.SIGTERM)
        time.sleep(3.0)
        assert rank0.is_running() and rank0.status() != psutil.STATUS_ZOMBIE  # the first one waits
        signalled = time.monotonic()
        rank0.send_signal(signal.SIGTERM)
        rank0.wait(timeout=10)  # (not its child: no exit code here; launch.py passes it on)
        print(f"second SIGTERM: rank 0 gone {time.monotonic() - signalled:.2f} s after it")
    finally:
        rank1.resume()
    assert run.wait() == PREEMPTED_EXIT_CODE, run.text()[-4000:]
    all_gone(processes, timeout=60)
    assert last_complete(out) == 4
    assert checkpoint.resolve_resume("latest", out / "checkpoints").name == checkpoint.tag_for_step(4)
    assert "SIGTERM again: stopping now; the last complete checkpoint is intact" in run.text()
