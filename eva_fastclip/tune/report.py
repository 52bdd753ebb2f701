"""What tune writes: the tuned experiment config and its DeepSpeed JSON, every trial, the console table."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from eva_fastclip.config import TUNED_SECTION
from eva_fastclip.tune.layouts import Trial
from eva_fastclip.tune.memory_model import GIB


def _gib(value: float | None) -> float | None:
    return None if value is None else round(value / GIB, 4)


def trial_row(trial: Trial) -> dict[str, Any]:
    """One trial as tuned.trials.json lists it."""
    c = trial.candidate
    return {
        "micro_batch": c.micro_batch,
        "grad_accum_steps": c.grad_accum_steps,
        "contrastive_batch": c.contrastive_batch,
        "contrastive_mode": c.contrastive,
        "grad_checkpointing": c.grad_checkpointing,
        "zero_stage": c.zero_stage,
        "est_peak_gib": _gib(trial.est_peak),
        "peak_gib": _gib(trial.peak),
        "samples_per_s": None if trial.samples_per_s is None else round(trial.samples_per_s, 3),
        "data_wait": None if trial.data_wait is None else round(trial.data_wait, 4),
        "verdict": trial.verdict,
        "why": trial.why,
        "estimate_gib": {k: _gib(v) for k, v in trial.estimate.items()},
    }


def format_table(trials: list[Trial], limit_gib: float, budget_gib: float) -> str:
    """The console's table: probed trials first, then the estimated ones that fit, largest batch first."""
    shown = sorted(
        trials,
        key=lambda t: (t.peak is None and not t.oom, t.verdict != "chosen", -t.candidate.micro_batch),
    )
    probed = [t for t in shown if t.peak is not None or t.oom]
    rest = [t for t in shown if t.peak is None and not t.oom and t.verdict in ("fits", "chosen")]
    header = (
        f"{'micro':>5} {'accum':>5} {'contr.':>7} {'ckpt':>4} {'zero':>4} {'est GiB':>8} {'peak GiB':>8} "
        f"{'samples/s':>9} {'data wait':>9}  verdict"
    )
    lines = [
        f"memory limit {limit_gib:.3g} GiB, budget {budget_gib:.3g} GiB (the limit less the margin)",
        header,
    ]
    for t in probed + rest[:8]:
        c = t.candidate
        lines.append(
            f"{c.micro_batch:>5} {c.grad_accum_steps:>5} {c.contrastive_batch:>6}"
            + ("g" if c.contrastive == "global" else " ")
            + f" {'on' if c.grad_checkpointing else 'off':>4} {c.zero_stage:>4} {t.est_peak / GIB:>8.3f} "
            f"{'' if t.peak is None else f'{t.peak / GIB:.3f}':>8} "
            f"{'' if t.samples_per_s is None else f'{t.samples_per_s:.1f}':>9} "
            f"{'' if t.data_wait is None else f'{t.data_wait:.1%}':>9}  {t.verdict}"
            + (f" ({t.why})" if t.why else "")
        )
    hidden = len(trials) - len(probed) - min(len(rest), 8)
    if hidden:
        lines.append(
            f"... and {hidden} more estimated (the trials file lists every one); g: contrastive_batch=global"
        )
    return "\n".join(lines)


def tuned_config(
    raw: dict[str, Any], trial: Trial, ds_path: str, data: dict[str, Any], record: dict[str, Any]
) -> dict[str, Any]:
    """The input config's keys with the tuned ones set, and a ``tuned`` section saying what chose each."""
    c = trial.candidate
    out = copy.deepcopy(raw)
    out.pop(TUNED_SECTION, None)
    train, model, data_section = (out.setdefault(k, {}) for k in ("train", "model", "data"))
    train.update(
        deepspeed_config=ds_path,
        global_batch=c.global_batch,
        max_micro_batch=c.micro_batch,
        batch_size=None,
        grad_accum_steps=None,
        contrastive_batch=c.contrastive,
    )
    model["grad_checkpointing"] = c.grad_checkpointing
    if data.get("workers") is not None:
        data_section["workers"] = data["workers"]
    if data.get("image_decode") is not None:
        data_section["image_decode"] = data["image_decode"]
    out[TUNED_SECTION] = record
    return out


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)  # a kill mid-write leaves the previous file whole


def trials_path(output: Path) -> Path:
    """tuned.json -> tuned.trials.json"""
    return output.with_name(output.stem + ".trials.json")


def ds_path(output: Path) -> Path:
    """tuned.json -> tuned.ds.json"""
    return output.with_name(output.stem + ".ds.json")


def trials_payload(
    trials: list[Trial],
    *,
    fingerprint: str,
    global_batch: int,
    world_size: int,
    limit: int,
    budget: int,
    in_flight: str | None = None,
) -> dict[str, Any]:
    """tuned.trials.json: every trial, whether it was probed, and the probe in flight (if any)."""
    rows = []
    for t in trials:
        row = trial_row(t)
        row.update(name=t.candidate.name(), probed=t.peak is not None or t.oom, oom=t.oom)
        rows.append(row)
    return {
        "fingerprint": fingerprint,
        "global_batch": global_batch,
        "world_size": world_size,
        "memory_limit_gib": limit / GIB,
        "budget_gib": budget / GIB,
        "in_flight": in_flight,
        "trials": rows,
    }


def read_previous(path: Path, fingerprint: str) -> dict[str, dict[str, Any]]:
    """The probes an earlier run of the same search (the same ``fingerprint``) wrote to ``path``, by name;
    the probe it died in counts as failed."""
    if not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if saved.get("fingerprint") != fingerprint:
        return {}
    previous = {
        row["name"]: {
            "peak": None if row["peak_gib"] is None else int(row["peak_gib"] * GIB),
            "oom": row["oom"],
            "samples_per_s": row["samples_per_s"],
            "why": row["why"] if row["oom"] else "",
        }
        for row in saved.get("trials", [])
        if row.get("probed")
    }
    died_in = saved.get("in_flight")
    if died_in:  # killed in it (a hang its watchdog ended, a device error): not probed again
        previous[died_in] = {
            "peak": None,
            "oom": True,
            "samples_per_s": None,
            "why": "the previous search ended during this probe (killed, hung or the device failed)",
        }
    return previous
