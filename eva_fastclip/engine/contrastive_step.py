"""How a step's micro-batches become gradients: one loss evaluation per micro-batch, or one per step.

``train.contrastive_batch`` chooses what each loss evaluation sees (docs/losses.md, Gradient accumulation):

- ``micro`` (:class:`MicroBatchStep`): each micro-batch's forward, its loss over the micro-batch across
  the ranks (c = b·K pairs), ``engine.backward``, ``engine.step``; DeepSpeed steps the optimizer at the
  accumulation boundary.
- ``global`` (:class:`CachedStep`): the optimizer step of K ranks × a micro-batches of b pairs is the step
  of one rank taking all G = a·b·K pairs in one micro-batch:
    1. every micro-batch goes forward without autograd as it arrives: the features of this rank's a·b
       pairs; the micro-batches are held (their images on the device, uint8 as the loader hands them);
    2. once the last has arrived, the loss takes the features, gathers every rank's (G pairs) and stages
       the per-sample state once (``begin_cached_step``);
    3. every micro-batch goes forward again with autograd and backpropagates its loss against all G
       pairs, its own live (``cached_forward``): the engine's mean over ranks and micro-batches is the
       gradient over G, with no feature gradient sent between ranks.
  Both passes mask a sample's tokens alike (its mask comes from its key: models/masking.py), and pass 2
  replays each micro-batch's random draws of pass 1 (the generators' states, as GradCache's RandContext
  does: dropout, drop-path), so pass 2 computes exactly the features pass 1 cached and the step is exact
  up to the order of float sums. Batch-dependent layers are the exception: BatchNorm (RN towers)
  normalises over each micro-batch of b, as the reference's towers do over each GPU's batch of b (no
  SyncBN), and its running statistics are put back after pass 1, so they are updated once per
  micro-batch, as without caching. The cost: pass 1 (a forward without autograd) and the features of G
  pairs on every rank (:func:`held_bytes`).

Each step kind's ``add(batch)`` takes one micro-batch and returns the loss outputs of the micro-batches it
backpropagated and whether the optimizer step was taken (DeepSpeed's accumulation boundary). It names each
phase of its work to ``note`` (the hang watchdog's: reliability/watchdog.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from eva_fastclip.losses import ContrastiveLoss, LossOutput
from eva_fastclip.models.masking import keyed_masks


@dataclass
class MicroBatch:
    images: torch.Tensor  # on the device, not yet the model's input (uint8 from TrainLoader)
    tokens: torch.Tensor
    indices: torch.Tensor
    keys: torch.Tensor  # each sample's key: its token mask (data/sample_keys.py)


ModelInput = Callable[[torch.Tensor], torch.Tensor]  # held images -> the model's input (normalised, dtype)


def running_statistics(module: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's running statistics in ``module`` (RN towers): state that a forward pass changes."""
    return [
        buffer
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
        if buffer is not None
    ]


def held_bytes(layout, embed_dim: int, image_shape: tuple[int, ...], image_bytes: int = 1) -> dict[str, int]:
    """What a cached step holds on each rank: the features of the step's G pairs (image and text, fp32,
    gathered) and its own micro-batches' images until pass 2 (uint8 from the loader: 1 byte a value)."""
    return {
        "features": 2 * layout.global_batch * embed_dim * 4,
        "images": layout.per_rank * math.prod(image_shape) * image_bytes,
    }


def held_memory(layout, embed_dim: int, image_shape: tuple[int, ...], image_bytes: int = 1) -> str:
    """The start-up log's line on :func:`held_bytes`."""
    held = held_bytes(layout, embed_dim, image_shape, image_bytes)
    return (
        f"train.contrastive_batch=global: each rank holds the features of the step's {layout.global_batch} "
        f"pairs ({held['features'] / 2**20:.1f} MiB) and its {layout.per_rank} images of the step "
        f"({held['images'] / 2**20:.1f} MiB) until their second pass"
    )


def _forward(
    engine, model_input: ModelInput, batch: MicroBatch, timed: Callable[[], contextlib.AbstractContextManager]
):
    """The model's features and logit_scale, and its logit_bias when it has one (SigLIP's), all fp32."""
    with timed():  # the rank's own work, no collective: what tells a straggler (reliability/stragglers.py)
        outputs = engine(model_input(batch.images), batch.tokens)
    # the loss runs in fp32 whatever the module's precision: logits of a large batch need the range
    return tuple(output.float() for output in outputs[:4])


def _loss_inputs(loss: ContrastiveLoss, outputs: tuple) -> tuple[tuple, dict]:
    """The features and logit_scale as positional arguments, the logit_bias as a keyword for a loss that
    takes one (a model without one gives None, which such a loss refuses by name)."""
    extra = {"logit_bias": outputs[3] if len(outputs) > 3 else None} if loss.uses_logit_bias else {}
    return outputs[:3], extra


def _no_note(phase: str) -> None:
    pass


class MicroBatchStep:
    """``train.contrastive_batch: micro``: one loss evaluation per micro-batch."""

    def __init__(self, engine, loss: ContrastiveLoss, model_input: ModelInput) -> None:
        self.engine, self.loss, self.model_input = engine, loss, model_input
        self.note: Callable[[str], None] = _no_note
        # times each forward (reliability/stragglers.py's ForwardTimer in training)
        self.timed: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def add(self, batch: MicroBatch) -> tuple[list[LossOutput], bool]:
        engine, note = self.engine, self.note
        # the keys stay set over the backward: a checkpointed forward runs again there
        with keyed_masks(engine.module, batch.keys):
            note("forward")
            outputs, extra = _loss_inputs(self.loss, _forward(engine, self.model_input, batch, self.timed))
            note("loss (its collectives: feature gather, per-sample state)")
            out = self.loss(*outputs, batch.indices, **extra)
            note("backward (and its gradient reduction)")
            engine.backward(out.loss)
        boundary = engine.is_gradient_accumulation_boundary()
        note("optimizer step" if boundary else "micro-step")
        engine.step()
        return [out], boundary


class CachedStep:
    """``train.contrastive_batch: global``: one loss evaluation over the whole optimizer step. Pass 1 runs
    each micro-batch as it arrives (the loader's next batches load meanwhile), pass 2 once the last one
    has."""

    def __init__(self, engine, loss: ContrastiveLoss, model_input: ModelInput, micro_batches: int) -> None:
        self.engine, self.loss, self.model_input = engine, loss, model_input
        self.note: Callable[[str], None] = _no_note
        # times each forward (reliability/stragglers.py's ForwardTimer in training)
        self.timed: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.micro_batches = micro_batches
        self._running_stats = running_statistics(engine.module)
        self._saved_stats: list[torch.Tensor] = []
        self._held: list[MicroBatch] = []
        self._features: list[tuple[torch.Tensor, ...]] = []
        self._rng: list[tuple] = []  # the generators' states before each pass-1 forward

    def add(self, batch: MicroBatch) -> tuple[list[LossOutput], bool]:
        engine = self.engine
        if not self._held:  # the step's first micro-batch: pass 1 must leave BatchNorm's statistics alone
            self._saved_stats = [buffer.clone() for buffer in self._running_stats]
        self._rng.append(_rng_state(batch.images.device))
        self.note("forward without autograd (pass 1)")
        with torch.no_grad(), keyed_masks(engine.module, batch.keys):  # pass 1: this micro-batch's features
            self._features.append(_forward(engine, self.model_input, batch, self.timed))
        self._held.append(batch)
        if len(self._held) < self.micro_batches:
            return [], False
        for buffer, value in zip(self._running_stats, self._saved_stats, strict=True):
            buffer.copy_(value)  # pass 2 updates them, once per micro-batch
        held, features, rng = self._held, self._features, self._rng
        self._held, self._features, self._saved_stats, self._rng = [], [], [], []
        return self._step(held, features, rng), True

    def _step(self, held: list[MicroBatch], features: list, rng: list) -> list[LossOutput]:
        engine, loss = self.engine, self.loss
        image_features, text_features, logit_scales = zip(*(outputs[:3] for outputs in features))
        self.note("loss set-up (its collectives: feature gather, per-sample state)")
        loss.begin_cached_step(
            torch.cat(image_features),
            torch.cat(text_features),
            logit_scales[0],
            torch.cat([batch.indices for batch in held]),
            micro_batch=held[0].indices.shape[0],
        )
        del features, image_features, text_features
        outs = []
        try:
            for micro, batch in enumerate(held):  # pass 2: each micro-batch's gradient
                _set_rng_state(rng[micro])  # the random draws of its pass 1
                with keyed_masks(engine.module, batch.keys):
                    self.note("forward (pass 2)")
                    outputs, extra = _loss_inputs(loss, _forward(engine, self.model_input, batch, self.timed))
                    out = loss.cached_forward(*outputs, micro, **extra)
                    self.note("backward (and its gradient reduction)")
                    engine.backward(out.loss)
                self.note("optimizer step" if micro == len(held) - 1 else "micro-step")
                engine.step()
                outs.append(out)
        finally:
            loss.end_cached_step()
        return outs


def _rng_state(device: torch.device) -> tuple:
    """The generators a forward on ``device`` draws from (dropout, drop-path): the CPU's and the device's."""
    return torch.get_rng_state(), (
        device,
        torch.cuda.get_rng_state(device),
    ) if device.type == "cuda" else None


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda[1], cuda[0])
