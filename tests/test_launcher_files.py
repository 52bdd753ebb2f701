"""What of launchers/ cannot run here (no sbatch, no SLURM controller, no Kubernetes cluster) is checked for
form: every shell launcher parses (``bash -n``); the batch script's ``#SBATCH`` lines are options sbatch
takes, in its syntax, and ask for what docs/launching.md says (the USR1 warning to the batch shell, the
requeue); the Kubernetes Job is a batch/v1 Job whose PID 1 is the launcher, whose pod failure policy
ignores exit code 75 and fails the Job on 2, 3 and 4, and whose command names files of this checkout. Their
behaviour under real signals: tests/launched/test_preemption.py (PID 1), test_straggler_runs.py and
test_multi_node.py (the batch script)."""

import re
import subprocess

import pytest
import yaml
from launching import REPO

LAUNCHERS = REPO / "launchers"

#: sbatch's long options this project's batch script may use, and the form of their values
SBATCH_OPTIONS = {
    "job-name": r"\S+",
    "nodes": r"\d+(-\d+)?",
    "ntasks-per-node": r"\d+",
    "gpus-per-node": r"(\w+:)?\d+",
    "cpus-per-task": r"\d+",
    "time": r"(\d+-)?\d+(:\d\d){0,2}",
    "signal": r"((R|B|RB|BR):)?(SIG)?[A-Z0-9]+(@\d+)?",
    "requeue": None,
    "open-mode": r"append|truncate",
    "output": r"\S+",
}


@pytest.mark.parametrize(
    "script", sorted(p.name for p in LAUNCHERS.iterdir() if p.suffix in (".sh", ".sbatch"))
)
def test_every_shell_launcher_parses(script):
    result = subprocess.run(["bash", "-n", str(LAUNCHERS / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def sbatch_lines() -> dict[str, str | None]:
    found = {}
    for line in (LAUNCHERS / "slurm.sbatch").read_text().splitlines():
        if line.startswith("#SBATCH"):
            match = re.fullmatch(r"#SBATCH --([a-z-]+)(=(\S+))?", line)
            assert match, f"not an sbatch long option: {line!r}"
            found[match[1]] = match[3]
    return found


def test_the_sbatch_lines_are_sbatch_options_in_its_syntax():
    lines = sbatch_lines()
    for name, value in lines.items():
        assert name in SBATCH_OPTIONS, f"--{name} is not one of the options checked here"
        form = SBATCH_OPTIONS[name]
        assert (value is None) == (form is None), f"--{name}: {value!r}"
        assert form is None or re.fullmatch(form, value), f"--{name}={value} is not sbatch's form {form}"
    # the warning goes to the batch shell only (B:), ahead of the limit; a saved run asks to be requeued
    assert re.fullmatch(r"B:USR1@\d+", lines["signal"]) and "requeue" in lines
    assert "train.preempt_signal=SIGUSR1" in (LAUNCHERS / "slurm.sbatch").read_text()


def test_the_kubernetes_job_runs_the_launcher_as_pid_1_and_resumes_on_75():
    job = yaml.safe_load((LAUNCHERS / "k8s_job.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert isinstance(pod["terminationGracePeriodSeconds"], int) and pod["terminationGracePeriodSeconds"] > 30
    (container,) = pod["containers"]
    command = container["command"]
    # an exec form, no shell in between: the launcher (which execs the supervisor) is PID 1
    assert command[0] == "launchers/single_node.sh" and (REPO / command[0]).is_file()
    assert (REPO / command[1]).is_file() and command[-2:] == ["--resume", "latest"]
    rules = {
        tuple(rule["onExitCodes"]["values"]): rule["action"]
        for rule in job["spec"]["podFailurePolicy"]["rules"]
        if "onExitCodes" in rule
    }
    assert rules == {(75,): "Ignore", (2, 3, 4): "FailJob"}
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == container["name"]
            assert rule["onExitCodes"]["operator"] == "In"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"] for volume in pod["volumes"]}
    assert set(mounts) == volumes and mounts["shm"] == "/dev/shm"
