"""The training steps benchmarks.speed and benchmarks.accumulation time: ours (``Trainer.train_step``) and
OpenCLIP's own, eager or compiled, on one synthetic batch, in one precision for both sides.

Each contestant's ``step(images, tokens, indices)`` returns the loss and sets ``phases`` (seconds): the
forward (model and loss), the backward (autograd), and everything after the backward until the next step
may begin (``after_backward``: for ours the gradient reduction DeepSpeed runs at the end of
``engine.backward``, the engine's step and our hooks; for OpenCLIP the optimizer step and the clamp). A
step compiled as one closure has no phases (None).
"""

from __future__ import annotations

import math
import time

import torch

#: open_clip_train's defaults for ViT models (params.py: get_default_params) and its step's clamp
OPENCLIP_LR, OPENCLIP_BETAS, OPENCLIP_EPS, OPENCLIP_WD = 5e-4, (0.9, 0.98), 1e-6, 0.2
LOGIT_SCALE_MAX = math.log(100.0)
PRECISIONS = ("bf16", "fp32")


class SyntheticLoader:
    """The same pre-built batch again and again: what ``Trainer`` needs from a loader, and nothing more."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_batches: int) -> None:
        self.batch = batch
        self.num_batches = num_batches
        self.dataset_size = int(batch[2].max()) + 1  # indices are 0..B-1

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        for _ in range(self.num_batches):
            yield self.batch


def synthetic_batch(
    batch_size: int, image_size: tuple[int, int], context_length: int, vocab_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random images (fp32, normalised-looking), random token ids, indices 0..B-1."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, *image_size, generator=gen)
    tokens = torch.randint(1, vocab_size, (batch_size, context_length), generator=gen, dtype=torch.long)
    return images, tokens, torch.arange(batch_size)


def image_size(model: torch.nn.Module) -> tuple[int, int]:
    size = model.visual.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def synchronized_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def native_precision() -> str:
    """bf16 where the device computes it natively (a CUDA GPU with bf16, a CPU with AMX / AVX-512 BF16),
    else fp32: what ``train.precision: auto`` trains in on CPU and bf16 GPUs."""
    from eva_fastclip.plan.precision import detect_hardware

    return "bf16" if detect_hardware().native_bf16 else "fp32"


class OpenClipStep:
    """OpenCLIP's training step (accum_freq 1, no grad clipping: open_clip_train's defaults) in
    ``precision``: ``amp_bf16`` (an fp32 model under ``torch.autocast(bfloat16)``) or ``fp32``.

    ``compiled``: ``--torchcompile --torchcompile-strategy step`` as open_clip_train has it since 4.1
    (``_make_train_step_no_accum_no_scaler``): the forward, the loss, the backward and the optimizer step
    in one ``torch.compile``'d closure, the learning rate a tensor (no recompile when it changes),
    ``zero_grad`` and the clamp outside it. open_clip_torch 3.3 (installed) compiles the model only."""

    def __init__(
        self, arch: str, patch_dropout: float, precision: str = "bf16", compiled: bool = False
    ) -> None:
        import open_clip

        import eva_fastclip.models  # noqa: F401  (registers the shipped toy architectures with open_clip)

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.model = open_clip.create_model(
            arch, force_patch_dropout=patch_dropout, pretrained_text=False, output_dict=True
        )
        self.model.train()
        self.loss = open_clip.loss.ClipLoss()
        # open_clip_train/main.py: no weight decay on gains, biases and the temperature
        exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        lr = torch.tensor(OPENCLIP_LR) if compiled else OPENCLIP_LR
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
                {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": OPENCLIP_WD},
            ],
            lr=lr,
            betas=OPENCLIP_BETAS,
            eps=OPENCLIP_EPS,
        )
        self.autocast = precision == "bf16"
        self.device_type = "cpu" if not torch.cuda.is_available() else "cuda"
        self.device = torch.device(self.device_type)
        self.model.to(self.device)
        self.compiled = torch.compile(self._closure) if compiled else None
        self.phases: dict[str, float | None] = {}

    def _forward_loss(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(images, tokens)
            return self.loss(out["image_features"], out["text_features"], out["logit_scale"])

    def _closure(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        loss = self._forward_loss(images, tokens)
        loss.backward()
        self.optimizer.step()
        return loss

    def step(self, images: torch.Tensor, tokens: torch.Tensor, indices: torch.Tensor) -> float:
        start = time.perf_counter()
        images = images.to(self.device, non_blocking=True)
        tokens = tokens.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        if self.compiled is not None:
            loss = self.compiled(images, tokens)
            self.phases = {"forward": None, "backward": None, "after_backward": None}
        else:
            loss = self._forward_loss(images, tokens)
            forward_done = synchronized_time()
            loss.backward()
            backward_done = synchronized_time()
            self.optimizer.step()
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        value = loss.item()
        if self.compiled is None:
            self.phases = {
                "forward": forward_done - start,
                "backward": backward_done - forward_done,
                "after_backward": time.perf_counter() - backward_done,
            }
        return value

    def close(self) -> None:
        pass


def bench_trainer(
    arch: str,
    patch_dropout: float,
    batch_size: int,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    output_dir: str,
    ds_config_path: str,
    extra: tuple[str, ...] = (),
    micro_batches: int = 1,
):
    """A Trainer of the default recipe with OpenCLIP's loss, fed ``batch`` by a synthetic loader (an epoch
    of ``micro_batches``: the caller feeds ``train_step`` itself)."""
    from eva_fastclip.config import load_config
    from eva_fastclip.engine.build import build_trainer
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

    cfg = load_config(
        None,
        [
            f"model.name={arch}",
            f"model.patch_dropout={patch_dropout}",
            "loss.name=openclip",  # the same loss as OpenCLIP's ClipLoss: the step is what we compare
            f"train.batch_size={batch_size}",
            "train.steps=1000000",
            f"train.deepspeed_config={ds_config_path}",
            f"train.output_dir={output_dir}",
            "train.log_every_steps=1000000",
            "eval.every_steps=0",  # and no zero-shot / retrieval sets: evaluation off
            *extra,
        ],
    )
    return build_trainer(
        cfg, load_deepspeed_config(ds_config_path), loader=SyntheticLoader(batch, micro_batches)
    )


class OursStep:
    """Our ``Trainer.train_step``, on a Trainer built from ``ds_config`` with a synthetic loader, in
    ``precision`` (``train.precision``); ``compiled``: ``train.compile=true``."""

    def __init__(
        self,
        arch: str,
        patch_dropout: float,
        batch_size: int,
        batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        output_dir: str,
        ds_config_path: str,
        precision: str = "bf16",
        compiled: bool = False,
    ) -> None:
        extra = (f"train.precision={precision}", *(["train.compile=true"] if compiled else []))
        self.trainer = bench_trainer(
            arch, patch_dropout, batch_size, batch, output_dir, ds_config_path, extra
        )
        # phase timers around the engine's backward, its gradient reduction (which the backward runs last,
        # at the step's boundary) and its step: the trainer and the engine call them by attribute
        engine = self.trainer.engine
        self._marks: dict[str, float] = {}
        for phase in ("backward", "allreduce_gradients", "step"):
            engine.__dict__[phase] = self._timed(phase, getattr(engine, phase))
        self.phases: dict[str, float | None] = {}

    def _timed(self, phase: str, method):
        def run(*args, **kwargs):
            self._marks[phase + "_start"] = synchronized_time()
            out = method(*args, **kwargs)
            self._marks[phase + "_end"] = synchronized_time()
            return out

        return run

    def step(self, images: torch.Tensor, tokens: torch.Tensor, indices: torch.Tensor) -> float:
        self._marks.clear()
        start = time.perf_counter()
        metrics = self.trainer.train_step(images, tokens, indices)
        end = time.perf_counter()
        self.trainer.step += 1
        m = self._marks
        reduce = m.get("allreduce_gradients_end", 0.0) - m.get("allreduce_gradients_start", 0.0)
        self.phases = {  # forward: the model and the loss; after the backward: reduction, step, hooks
            "forward": m["backward_start"] - start,
            "backward": m["backward_end"] - m["backward_start"] - reduce,
            "after_backward": end - m["backward_end"] + reduce,
        }
        return metrics["loss"]

    def close(self) -> None:
        if self.trainer.writer is not None:
            self.trainer.writer.close()
