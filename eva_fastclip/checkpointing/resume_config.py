"""What a resumed run takes from the config it is given, and what it refuses.

A checkpoint keeps the experiment config it was trained with and the DeepSpeed settings that shape its
optimizer (``config`` and ``deepspeed`` in its marker). DeepSpeed's load puts the checkpoint's optimizer
settings back (every group's weight decay, betas and eps, the schedule's peak lrs), so without this
module a resumed run given a lowered ``optim.lr`` would go on at the old lr while config.json recorded the
new one. Every key of the config is one of:

- ``change``: the new value applies from the next step. Most keys are read afresh by whatever uses them;
  the optimizer's are set again after the load (:func:`reapply_optimizer_settings`): each group's peak lr
  (the schedule multiplies it), weight decay, betas and eps, as the new config builds them.
- ``start``: read only when a run starts (initial weights, initial temperature); the checkpoint's state
  wins, and a change is logged as having no effect.
- ``fixed``: the checkpoint cannot go on under another value (the architecture, the loss, the trainable
  parameters, the per-sample table's size, the warm-up, the optimizer type, the ZeRO stage, bf16 by
  autocast or by DeepSpeed's bf16 module): the run
  stops before step 1 naming the key, both values and the way out.
- ``elsewhere``: decided by other code (``train.precision``: plan/precision.py's ``for_resume``).

Each change is logged once on rank 0, e.g. ``optim.lr 0.001 -> 1e-05 on resume``. docs/checkpoints.md
lists every key with its rule and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from eva_fastclip.config import ConfigError
from eva_fastclip.losses import LOSSES, CompositionalLoss

CHANGE, START, FIXED, ELSEWHERE = "change", "start", "fixed", "elsewhere"


@dataclass(frozen=True, slots=True)
class Rule:
    kind: str
    why: str = ""
    """fixed: why the checkpoint cannot go on under another value; start: what the run takes instead."""
    per_sample_only: bool = False
    """fixed only where the saved loss keeps per-sample state (else: change)."""


_ARCH = "the checkpoint's weights belong to its architecture"
_FIRST = "only a run's start reads it: the weights come from the checkpoint"

#: Every key of the experiment config (flattened) and of the DeepSpeed settings we track (``deepspeed.``).
RULES: dict[str, Rule] = {
    "model.name": Rule(FIXED, _ARCH),
    "model.pretrained": Rule(START, _FIRST),
    "model.patch_dropout": Rule(CHANGE),
    "model.grad_checkpointing": Rule(CHANGE),
    "model.unmasked_final_steps": Rule(CHANGE),
    "model.vision_checkpoint": Rule(START, _FIRST),
    "model.text_checkpoint": Rule(START, _FIRST),
    "model.text_checkpoint_skip": Rule(START, _FIRST),
    "model.text_hf_model": Rule(FIXED, "the text tower's architecture and tokenizer come from that folder"),
    "model.lock_text": Rule(FIXED, "it decides which parameters the optimizer and its saved state hold"),
    # the data may change: the epoch goes on at shard granularity (docs/checkpoints.md)
    "data.train_shards": Rule(CHANGE),
    "data.train_weights": Rule(CHANGE),
    "data.resampled": Rule(CHANGE),
    "data.num_samples": Rule(CHANGE),
    "data.index_size": Rule(FIXED, "the loss's per-sample state has one row per index", per_sample_only=True),
    "data.shuffle_buffer": Rule(CHANGE),
    "data.workers": Rule(CHANGE),
    "data.index_key": Rule(CHANGE),
    "data.image_decode": Rule(CHANGE),  # the same crops either way: only where the decode runs changes
    "train.remote_dir": Rule(CHANGE),  # where copies go: the run's state is the same
    "data.caption_keys": Rule(CHANGE),  # which captions train from here on: the data, not the state
    "data.caption_weights": Rule(CHANGE),
    "data.read_retries": Rule(CHANGE),  # how a failed request is retried: not what is read
    "data.retry_wait_s": Rule(CHANGE),
    "loss.name": Rule(FIXED, "the loss decides the per-sample state and the temperature's optimizer group"),
    "loss.temperature_rule": Rule(
        FIXED, "the rule decides the temperature's optimizer group and the per-sample state"
    ),
    "loss.temperature_init": Rule(START, "only a run's start reads it: tau comes from the checkpoint"),
    "loss.logit_bias_init": Rule(START, "only a run's start reads it: the bias comes from the checkpoint"),
    "loss.temperature_min": Rule(CHANGE),
    "loss.temperature_max": Rule(CHANGE),
    "loss.temperature_lr": Rule(CHANGE),
    "loss.temperature_lr_drop_below": Rule(CHANGE),
    "loss.temperature_lr_drop_factor": Rule(CHANGE),
    "loss.temperature_lr_drop_rule": Rule(CHANGE),
    "loss.temperature_betas": Rule(CHANGE),
    "loss.temperature_momentum": Rule(CHANGE),
    "loss.temperature_grad_clip": Rule(CHANGE),
    "loss.gamma_schedule": Rule(CHANGE),
    "loss.gamma_min": Rule(CHANGE),
    "loss.gamma_decay_epochs": Rule(CHANGE),
    "loss.rho": Rule(CHANGE),
    "loss.eps": Rule(CHANGE),
    "loss.tau_gradient": Rule(CHANGE),
    "optim.lr": Rule(CHANGE),
    "optim.weight_decay": Rule(CHANGE),
    "optim.weight_decay_rule": Rule(
        FIXED, "it decides which parameters are in the decayed and the not decayed optimizer groups"
    ),
    "optim.warmup_steps": Rule(
        FIXED, "the warm-up is the part of the lr schedule the checkpoint has started or finished"
    ),
    "optim.min_lr_ratio": Rule(CHANGE),
    "optim.visual_lr": Rule(CHANGE),
    "optim.text_lr": Rule(CHANGE),
    "optim.visual_weight_decay": Rule(CHANGE),
    "optim.text_weight_decay": Rule(CHANGE),
    "optim.visual_layer_decay": Rule(CHANGE),
    "optim.text_layer_decay": Rule(CHANGE),
    "optim.temperature_trust_ratio": Rule(CHANGE),
    "optim.lamb_trust_ratio": Rule(CHANGE),
    "train.deepspeed_config": Rule(CHANGE),  # the path; the settings it holds are compared as deepspeed.*
    "train.precision": Rule(ELSEWHERE),
    # the batch may change (on another number of ranks, train.grad_accum_steps keeps the checkpoint's global
    # batch unless train.global_batch states it: Trainer._keep_global_batch)
    "train.global_batch": Rule(CHANGE),
    "train.max_micro_batch": Rule(CHANGE),
    "train.batch_size": Rule(CHANGE),
    "train.grad_accum_steps": Rule(CHANGE),
    "train.contrastive_batch": Rule(
        FIXED, "it decides the negatives of every loss evaluation: the run would change its objective midway"
    ),
    "train.epochs": Rule(CHANGE),
    "train.steps": Rule(CHANGE),
    "train.seed": Rule(CHANGE),
    "train.output_dir": Rule(CHANGE),
    "train.save_every_steps": Rule(CHANGE),
    "train.save_every_minutes": Rule(CHANGE),
    "train.hang_timeout_s": Rule(CHANGE),
    "train.hang_timeout_long_s": Rule(CHANGE),
    "train.straggler_factor": Rule(CHANGE),
    "train.straggler_windows": Rule(CHANGE),
    "train.preempt_signal": Rule(CHANGE),
    "train.keep_checkpoints": Rule(CHANGE),
    "train.log_every_steps": Rule(CHANGE),
    "train.peak_tflops": Rule(CHANGE),  # read afresh: the log's MFU
    "train.max_skipped_steps": Rule(CHANGE),
    "eval.zeroshot_dir": Rule(CHANGE),
    "eval.retrieval_shards": Rule(CHANGE),
    "eval.every_steps": Rule(CHANGE),
    "eval.batch_size": Rule(CHANGE),
    "eval.imagenet_val": Rule(CHANGE),
    "eval.workers": Rule(CHANGE),
    "eval.precision": Rule(CHANGE),
    "train.compile": Rule(CHANGE),  # the same weights and state, compiled or not
    "train.compile_backend": Rule(CHANGE),
    "deepspeed.optimizer.type": Rule(FIXED, "the saved optimizer state is that optimizer's"),
    "deepspeed.zero_optimization.stage": Rule(FIXED, "the saved optimizer state is laid out for that stage"),
    "deepspeed.torch_autocast.enabled": Rule(
        FIXED,
        "the saved optimizer state is the optimizer's own, not DeepSpeed's bf16 wrapper's (or the reverse)",
    ),
    "deepspeed.gradient_clipping": Rule(CHANGE),
}
#: keys whose null means "derived" (gamma's horizon from the run's length, the table's size from the data's
#: files): a change to or from null is no change here (a wrong table size stops the per-sample state's load)
_NULL_MEANS_DERIVED = ("loss.gamma_decay_epochs", "data.index_size")
#: what a checkpoint from before a key existed trained with
_BEFORE_THE_KEY = {"train.contrastive_batch": "micro", "deepspeed.torch_autocast.enabled": False}


@dataclass(frozen=True, slots=True)
class Change:
    key: str
    saved: Any
    new: Any
    rule: Rule

    @property
    def refused(self) -> bool:
        return self.rule.kind == FIXED

    def message(self) -> str:
        """The log line of an accepted change."""
        line = f"{self.key} {_show(self.saved)} -> {_show(self.new)} on resume"
        return line + (f" (no effect: {self.rule.why})" if self.rule.kind == START else "")

    def refusal(self, checkpoint: str) -> str:
        """Why the run cannot resume with this change, and what to do instead."""
        if self.key.startswith("deepspeed."):
            back = f"set {self.key.removeprefix('deepspeed.')}={_show(self.saved)} in train.deepspeed_config"
        else:
            back = f"resume with --set {self.key}={_show(self.saved)}"
        return (
            f"{checkpoint} was trained with {self.key}={_show(self.saved)} and this run gives "
            f"{_show(self.new)}, which cannot change on resume ({self.rule.why}): {back}, or start a new run "
            "in another train.output_dir"
        )


def compare(saved: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The keys whose value differs between a checkpoint's settings and a run's, each with its rule.

    ``saved`` and ``new`` hold the experiment config under ``config`` and may hold the DeepSpeed settings
    under ``deepspeed`` (:func:`deepspeed_settings`). A key only one side knows (a checkpoint from before
    the key existed, or a DeepSpeed setting an older checkpoint did not record) is left out, except those
    whose value before the key existed is known (``_BEFORE_THE_KEY``).
    """
    old, now = _settings(saved), _settings(new)
    if old:
        old = {**_BEFORE_THE_KEY, **old}
    per_sample = _keeps_per_sample_state(saved.get("config", {}).get("loss", {}).get("name"))
    changes = []
    for key in sorted(old.keys() & now.keys()):
        if old[key] == now[key] or (key in _NULL_MEANS_DERIVED and None in (old[key], now[key])):
            continue
        # deepspeed.optimizer.params.* (betas, eps, LAMB's bounds) and keys newer than this table: change
        rule = RULES.get(key, Rule(CHANGE))
        if rule.kind == ELSEWHERE:
            continue
        if rule.per_sample_only and not per_sample:
            rule = Rule(CHANGE)
        changes.append(Change(key, old[key], now[key], rule))
    return changes


def refuse(changes: list[Change], checkpoint: str) -> None:
    """Raise ConfigError naming every key that cannot change on resume."""
    refused = [change for change in changes if change.refused]
    if refused:
        lines = "\n".join(f"  - {change.key}: {change.refusal(checkpoint)}" for change in refused)
        raise ConfigError(f"{len(refused)} key(s) cannot change on resume:\n{lines}")


def deepspeed_settings(ds: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run compares of the resolved DeepSpeed JSON: the optimizer's type and its
    parameters other than lr and weight decay (the experiment config's), the ZeRO stage, the clipping."""
    optimizer = ds.get("optimizer", {})
    params = {k: v for k, v in optimizer.get("params", {}).items() if k not in ("lr", "weight_decay")}
    autocast = ds.get("torch_autocast")
    return {
        "optimizer": {"type": optimizer.get("type"), "params": params},
        "zero_optimization": {"stage": ds.get("zero_optimization", {}).get("stage", 0)},
        "gradient_clipping": ds.get("gradient_clipping", 0.0),
        "torch_autocast": {"enabled": isinstance(autocast, dict) and autocast.get("enabled") is True},
    }


# ---- the optimizer ---------------------------------------------------------------------------------

#: group settings the optimizer is built with from the config and the DeepSpeed JSON, and which a load
#: replaces with the checkpoint's; the lr is set through the scheduler's base_lrs (its peak)
GROUP_SETTINGS = ("weight_decay", "betas", "eps", "bias_correction", "max_coeff", "min_coeff")


def optimizer_settings(scheduler) -> list[dict[str, Any]]:
    """Each group's settings as this run built them from its config, with its peak lr: call before the
    checkpoint is loaded."""
    return [
        {"name": group.get("name"), "peak_lr": base, **{k: group[k] for k in GROUP_SETTINGS if k in group}}
        for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True)
    ]


def reapply_optimizer_settings(
    scheduler, built: list[dict[str, Any]], peak_scale: dict[str, float] | None = None
) -> None:
    """After the load: every group's peak lr (times ``peak_scale`` of its name, e.g. the temperature's
    one-time drop) and settings as the run built them, and its lr for the next step from the schedule at
    the point the checkpoint reached."""
    groups = scheduler.optimizer.param_groups
    names = [group.get("name") for group in groups]
    if names != [want["name"] for want in built]:
        raise RuntimeError(f"the checkpoint's optimizer groups {names} are not this run's")
    for i, (group, want) in enumerate(zip(groups, built)):
        peak = want["peak_lr"] * (peak_scale or {}).get(group.get("name"), 1.0)
        scheduler.base_lrs[i] = peak
        group["initial_lr"] = peak
        group.update({k: want[k] for k in GROUP_SETTINGS if k in want})
        group["lr"] = peak * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


# ---- helpers ---------------------------------------------------------------------------------------


def _settings(state: dict[str, Any]) -> dict[str, Any]:
    # through JSON: a marker's values and a live config's compare alike (tuples are lists)
    flat = _flatten(json.loads(json.dumps(state.get("config", {}))))
    flat.update(_flatten(json.loads(json.dumps(state.get("deepspeed", {}))), "deepspeed."))
    return flat


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _keeps_per_sample_state(loss_name: str | None) -> bool:
    return loss_name in LOSSES and issubclass(LOSSES[loss_name], CompositionalLoss)


def _show(value: Any) -> str:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return str(value) if number else json.dumps(value)  # 1e-05, "name", null, [0.9, 0.98]
