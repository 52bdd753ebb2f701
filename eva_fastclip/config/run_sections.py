"""The run's own sections, train and eval (how a run goes rather than what it trains), and the experiment
that holds every section; the others are config/sections.py's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .sections import (
    CONTRASTIVE_BATCHES,
    PRECISIONS,
    PREEMPT_SIGNALS,
    ConfigError,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    _positive,
    gamma_decay_epochs_for,
)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    zeroshot_dir: str | None = None
    """clip_benchmark-layout classification folder (test/*.tar, classnames.txt, templates)."""
    retrieval_shards: list[str] | None = None
    """Held-out image-text shards for image<->text retrieval."""
    imagenet_val: str | None = None
    """ImageNet validation folder DIR/<wnid>/*.JPEG (OpenCLIP's --imagenet-val): zero-shot top-1/5 with
    open_clip's class names and OpenAI's 80 prompts; a folder of some wnids is scored over those classes."""
    every_steps: int = 0
    """Evaluate every N optimizer steps (0: only at the end of training); every rank encodes its share."""
    batch_size: int = 128
    """Evaluation batch size (per rank: each rank encodes whole batches of the set)."""
    workers: int = 2
    """Image-decoding loader workers per rank during evaluation (0: decode in the rank's process)."""
    precision: str = "auto"
    """auto, bf16, fp16 or fp32: what the towers compute in. auto: as the model trains (a bf16 run
    evaluates in bf16, as it holds its weights), and ``eva-fastclip eval`` as the checkpoint was trained,
    so both give a checkpoint the same figures; fp32: the fp32 weights (the masters in a bf16 run), as
    exports are evaluated elsewhere (docs/evaluation.md, Precision)."""

    def __post_init__(self) -> None:
        _positive("eval.every_steps", self.every_steps, allow_zero=True)
        _positive("eval.batch_size", self.batch_size)
        _positive("eval.workers", self.workers, allow_zero=True)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"eval.precision must be one of {PRECISIONS}, got {self.precision!r}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    deepspeed_config: str = "ds_configs/zero1_lamb.json"
    """DeepSpeed JSON: ZeRO stage, precision, clipping, optimizer type. Batch sizes there may be "auto"."""
    precision: str = "auto"
    """auto, bf16, fp16 or fp32. auto: bf16 where the device computes it natively (CUDA with bf16, CPUs
    with AVX-512 BF16 or AMX), fp16 with loss scaling on older CUDA devices, fp32 elsewhere."""
    compile: bool = False
    """torch.compile the vision and text towers (engine/compiled.py): the first steps take the compile's
    time, then each step is faster; a model or setting that cannot compile stops the run before step 1."""
    compile_backend: str = "inductor"
    """torch.compile's backend with train.compile (OpenCLIP's --torchcompile-backend): inductor generates
    fused kernels; aot_eager traces the same graphs without code generation (a quick check)."""
    global_batch: int | None = None
    """Pairs per optimizer step over all ranks: the recipe, the same on any number of ranks; the per-rank
    share, the micro-batch and the accumulation are derived from it (batch_layout). null: the batch is
    given per rank (train.batch_size, train.grad_accum_steps) and grows with the ranks."""
    max_micro_batch: int | None = None
    """With train.global_batch: the most pairs one rank holds in one forward pass (what fits its memory);
    a larger share of the global batch is accumulated over micro-batches. null: no bound."""
    batch_size: int | None = None
    """Micro-batch per rank (DeepSpeed's train_micro_batch_size_per_gpu); null: 64, or derived from
    train.global_batch (then it must stay null)."""
    grad_accum_steps: int | None = None
    """Micro-batches accumulated per optimizer step (DeepSpeed's gradient_accumulation_steps); null: 1, or
    derived from train.global_batch (then it must stay null)."""
    contrastive_batch: str = "micro"
    """The pairs each loss evaluation sees as negatives. micro: one micro-batch across the ranks (b x
    ranks); global: every pair of the optimizer step, as if one rank took the whole global batch in one
    forward pass, at the cost of one more forward pass per micro-batch (without autograd) and the step's
    features held on every rank (docs/losses.md, Gradient accumulation). The same without accumulation."""
    epochs: int = 1
    """Passes over data.num_samples; ignored when `steps` is set."""
    steps: int | None = None
    """Total optimizer steps; overrides `epochs`."""
    seed: int = 0
    """Seed for model init, data order and masking."""
    output_dir: str = "runs/default"
    """Checkpoints (output_dir/checkpoints), TensorBoard logs (output_dir/tensorboard), final metrics."""
    save_every_steps: int = 0
    """Save a sharded checkpoint every N optimizer steps (0: only at the end)."""
    save_every_minutes: float = 0.0
    """Also save when this many minutes have passed since the last save (0: off), decided on rank 0 so that
    every rank saves at the same step; beside train.save_every_steps."""
    hang_timeout_s: float = 600.0
    """The longest a rank may take over one phase of a step (a forward, a backward, a collective, a batch
    from the loader) before it logs what it was doing and which ranks it waits for, and exits (code 124;
    docs/reliability.md). 0: no watchdog (collectives then wait PyTorch's 30 minutes)."""
    hang_timeout_long_s: float = 1800.0
    """The same for start-up (process group, model, engine, a checkpoint's load), the first step,
    evaluations and saves."""
    preempt_signal: str | None = None
    """A signal that asks for a checkpoint and a stop, besides SIGTERM and SIGINT, e.g. "SIGUSR1" for SLURM's
    --signal (docs/reliability.md). The run saves at the next optimizer step and exits with code 75."""
    straggler_factor: float = 1.5
    """A rank whose own work per step (its forwards and its waits for its loader) exceeds the ranks' median
    by this factor in train.straggler_windows logging windows in a row is named with its host in a warning
    (docs/reliability.md). 0: measured and logged, never warned about."""
    straggler_windows: int = 5
    """Logging windows in a row a rank must be behind before it is named."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept; older ones are deleted only after a newer one is complete."""
    remote_dir: str | None = None
    """An object store's folder (s3://bucket/runs/x, gs://..., any fsspec URL) each complete checkpoint and
    the run's logs are copied to in the background; --resume latest on a fresh node brings the newest down
    (docs/checkpoints.md). train.keep_checkpoints applies there too. null: none."""
    log_every_steps: int = 10
    """TensorBoard logging period in optimizer steps (the console's progress bar shows every step's loss)."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s of one rank's device in the run's precision, which MFU divides by (perf/mfu);
    null: NVIDIA's figure for an A100, H100 or H200 (engine/throughput.py), no MFU on other devices."""
    max_skipped_steps: int = 20
    """Stop the run after this many optimizer steps in a row that were skipped (non-finite gradients) or
    had a non-finite loss, without saving over the last complete checkpoint; 0: never stop. 20 lets fp16's
    loss scaler come down from 2^16 to 1 (17 skipped steps) at the start of a run."""

    def __post_init__(self) -> None:
        if self.global_batch is None:
            if self.max_micro_batch is not None:
                raise ConfigError(
                    f"train.max_micro_batch={self.max_micro_batch} bounds the micro-batch derived from "
                    "train.global_batch, which is not set: set train.global_batch, or give the per-rank "
                    "batch as train.batch_size (and train.grad_accum_steps)"
                )
            self.batch_size = 64 if self.batch_size is None else self.batch_size
            self.grad_accum_steps = 1 if self.grad_accum_steps is None else self.grad_accum_steps
            _positive("train.batch_size", self.batch_size)
            _positive("train.grad_accum_steps", self.grad_accum_steps)
        else:
            _positive("train.global_batch", self.global_batch)
            if self.max_micro_batch is not None:
                _positive("train.max_micro_batch", self.max_micro_batch)
            for key in ("batch_size", "grad_accum_steps"):
                if getattr(self, key) is not None:
                    raise ConfigError(
                        f"train.{key}={getattr(self, key)} and train.global_batch={self.global_batch} "
                        f"are both set: with train.global_batch, train.{key} is derived from it and the "
                        f"number of ranks. Remove train.{key} (--set train.{key}=null); to bound what one "
                        "rank holds in a forward pass set train.max_micro_batch, or set "
                        "train.global_batch=null to give the batch per rank"
                    )
        _positive("train.epochs", self.epochs)
        if self.steps is not None:
            _positive("train.steps", self.steps)
        _positive("train.save_every_steps", self.save_every_steps, allow_zero=True)
        _positive("train.save_every_minutes", self.save_every_minutes, allow_zero=True)
        _positive("train.hang_timeout_s", self.hang_timeout_s, allow_zero=True)
        _positive("train.straggler_windows", self.straggler_windows)
        if self.straggler_factor and self.straggler_factor <= 1:
            raise ConfigError(
                f"train.straggler_factor={self.straggler_factor} must be above 1 (how many times the ranks' "
                "median a rank's own time must be to be named), or 0 to never warn"
            )
        _positive("train.hang_timeout_long_s", self.hang_timeout_long_s, allow_zero=True)
        if self.hang_timeout_s and self.hang_timeout_long_s < self.hang_timeout_s:
            raise ConfigError(
                f"train.hang_timeout_long_s={self.hang_timeout_long_s} is shorter than train.hang_timeout_s="
                f"{self.hang_timeout_s}: it is the allowance of the long phases (start-up, saves): raise it"
            )
        if self.preempt_signal is not None and self.preempt_signal not in PREEMPT_SIGNALS:
            raise ConfigError(
                f"train.preempt_signal={self.preempt_signal!r} is not a signal a run can catch: use one of "
                f"{', '.join(PREEMPT_SIGNALS)} (SIGTERM and SIGINT are always caught), or null"
            )
        _positive("train.keep_checkpoints", self.keep_checkpoints)
        if self.remote_dir is not None and "://" not in self.remote_dir:
            raise ConfigError(
                "train.remote_dir must be an object store's URL (s3://bucket/runs/x), got "
                f"{self.remote_dir!r}: train.output_dir is the local folder"
            )
        _positive("train.log_every_steps", self.log_every_steps)
        if self.peak_tflops is not None:
            _positive("train.peak_tflops", self.peak_tflops)
        _positive("train.max_skipped_steps", self.max_skipped_steps, allow_zero=True)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.contrastive_batch not in CONTRASTIVE_BATCHES:
            raise ConfigError(
                f"train.contrastive_batch must be one of {CONTRASTIVE_BATCHES}, got "
                f"{self.contrastive_batch!r}"
            )


@dataclass(kw_only=True, slots=True)
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        # FastCLIP: E ~ epochs / 2. With train.steps the epochs depend on the data and the ranks: the
        # trainer sets it (gamma_decay_epochs_for)
        if self.loss.is_compositional and self.loss.gamma_decay_epochs is None and self.train.steps is None:
            self.loss.gamma_decay_epochs = gamma_decay_epochs_for(self.train.epochs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
