"""The memory model of a training layout: one rank's peak tensor memory, estimated before any probe.

A rank's peak is its state plus the larger of two transients, each term a count of tensors the run
makes (DeepSpeed 0.19's ZeRO-0/1/2 engines, our LAMB or AdamW, our losses), with P the model's parameters
(T of them trained), K ranks, w the bytes of a weight (2 in bf16/fp16, 4 in fp32):

    state      weights P·w, the fp32 masters 4T (bf16/fp16; also fp32 under ZeRO-1/2, which copies its
               partition), the optimizer's two moments 8T — the masters and moments divided by K under
               ZeRO-1/2 — and the loss's per-sample table (host memory on a GPU: its own line)
    backward   the forward and backward's own peak a·b + a0 for a micro-batch of b (activations, the
               block recomputed under checkpointing, the backward's transients: traced by
               :func:`trace_activations`); the gradients T·w (T·w/K under ZeRO-2) beside them (the
               probes show that much more than the bare model holds, under ZeRO-0 and ZeRO-1 on 2 ranks:
               the gradients' storage, or the reduction's copy of them); the model's input (the uint8
               images normalised: 4 + w bytes a value); DeepSpeed's reduce bucket
               (``reduce_bucket_size`` elements of the gradient dtype, allocated anew at every
               backward under ZeRO-1/2 with ``contiguous_gradients``; two with ``overlap_comm``), the
               loss's buffers (:func:`loss_buffer_bytes`: the contrastive batch's gathered features, fp32,
               their gradients and streamed row blocks, as each loss makes them) and, with
               ``train.contrastive_batch=global``, the step's cached features and held images
               (engine/contrastive_step.py's ``held_bytes``)
    step       the gradients and their fp32 copy (4T, 4T/K under ZeRO-1/2) at the optimizer step, and
               LAMB's update ``u``, made in fp32 before the trust ratios are applied: of every tensor at
               ZeRO-0 (one call), of about the largest tensor under ZeRO-1/2 (a group a call)

Under bf16 by autocast (ZeRO-0 only: plan/precision.py) w is 4 and there are no masters; its activations
are the bf16 model's line (measured on ViT toy towers: autocast keeps 8% more, its bf16 weight copies).

The activation line is the one thing not counted from the parameters: it is traced (two micro-batch
sizes, forward and backward of the bare model on fake tensors in the run's precision) because attention
kernels, masking and checkpointing decide it. Probes then measure the whole peak; docs/benchmarks.md
compares the two.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
from typing import Any

import torch

from eva_fastclip.config import ExperimentConfig
from eva_fastclip.tensor_memory import StorageTracker

GIB = 2.0**30
#: DeepSpeed's default reduce_bucket_size (elements) when the JSON leaves it out
DEFAULT_REDUCE_BUCKET = 500_000_000
#: entries of one streamed row block of the compositional loss (losses/surrogate.py's _BLOCK_ELEMENTS), and
#: the fp32 block-sized tensors alive at once while it is recomputed in the backward
LOSS_BLOCK_ELEMENTS, LOSS_BLOCKS_LIVE = 2**18, 8
#: SigLIP's row blocks (losses/siglip.py's _BLOCK_ELEMENTS), two alive at once in either pass
SIGLIP_BLOCK_ELEMENTS, SIGLIP_BLOCKS_LIVE = 2**22, 2
#: per-sample table fields of each temperature rule (losses/compositional.py)
TABLE_FIELDS = {"individual_adam": 8, "individual_momentum": 6}
COMPOSITIONAL_FIELDS = 2


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What the memory model needs to know of a run: its model, precision, engine settings and data."""

    parameters: int
    trainable: int
    embed_dim: int
    image_shape: tuple[int, int, int]
    weight_bytes: int  # 2 (bf16 / fp16 module) or 4 (fp32)
    reduce_bucket_size: int  # elements
    overlap_comm: bool
    contiguous_gradients: bool
    table_rows: int  # per-sample table rows (0: the loss keeps none)
    table_fields: int
    #: bytes per sample and fixed bytes of a forward and backward, without and with grad checkpointing
    activations: dict[bool, tuple[float, float]]
    device: str = "cpu"  # where the tensors live: on CUDA the per-sample table is host memory
    largest_tensor: int = 0  # elements of the largest trained tensor (LAMB's update is made per tensor)
    optimizer: str = "Lamb"
    loss: str = "fastclip_v3"  # loss.name: what the loss's buffers are
    autocast_at_zero0: bool = False  # bf16 by autocast over fp32 weights at ZeRO-0 (plan/precision.py)

    @property
    def image_bytes(self) -> int:
        """A held image: uint8 as TrainLoader hands it."""
        return math.prod(self.image_shape)


def footprint_of(
    cfg: ExperimentConfig,
    ds: dict[str, Any],
    *,
    parameters: int,
    trainable: int,
    embed_dim: int,
    image_shape: tuple[int, int, int],
    table_rows: int,
    activations: dict[bool, tuple[float, float]],
    device: str,
    largest_tensor: int = 0,
    autocast_at_zero0: bool = False,
) -> Footprint:
    """The footprint of ``cfg`` under the resolved DeepSpeed JSON ``ds``."""
    zero = ds.get("zero_optimization", {})
    lowp = ds.get("bf16", {}).get("enabled") is True or ds.get("fp16", {}).get("enabled") is True
    rule = cfg.loss.temperature_rule
    return Footprint(
        parameters=parameters,
        trainable=trainable,
        embed_dim=embed_dim,
        image_shape=image_shape,
        weight_bytes=2 if lowp else 4,
        reduce_bucket_size=int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)),
        overlap_comm=bool(zero.get("overlap_comm", False)),
        contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
        table_rows=table_rows if cfg.loss.is_compositional else 0,
        table_fields=TABLE_FIELDS.get(rule, COMPOSITIONAL_FIELDS),
        activations=activations,
        device=device,
        largest_tensor=largest_tensor,
        optimizer=ds.get("optimizer", {}).get("type", "Lamb"),
        loss=cfg.loss.name,
        autocast_at_zero0=autocast_at_zero0,
    )


def loss_buffer_bytes(loss: str, b: int, c: int, d: int) -> int:
    """The loss's own tensors at its peak, for b local pairs in a contrastive batch of c, d dimensions:
    SigLIP all-gathers the features without autograd (2·c·d fp32) and makes one half's feature gradient
    (b·d) beside two row blocks of at most SIGLIP_BLOCK_ELEMENTS logits (its peak, as tensor_memory's
    StorageTracker measures it: tests/test_siglip_loss.py); the others keep the gathered features and
    their gradients (4·c·d) and LOSS_BLOCKS_LIVE streamed blocks."""
    if loss == "siglip":
        block = min(b, max(1, SIGLIP_BLOCK_ELEMENTS // c)) * c
        return (2 * c * d + b * d + SIGLIP_BLOCKS_LIVE * block) * 4
    return 2 * 2 * c * d * 4 + min(b * c, LOSS_BLOCK_ELEMENTS) * 4 * LOSS_BLOCKS_LIVE


def estimate(candidate, fp: Footprint) -> dict[str, int]:
    """One rank's peak tensor memory for ``candidate`` (tune/layouts.py's Candidate), term by term
    (module docstring); ``peak`` is their sum at the larger transient, ``host`` what lives in host
    memory instead on a GPU (the per-sample table)."""
    k, stage, t, w = candidate.world_size, candidate.zero_stage, fp.trainable, fp.weight_bytes
    autocast = stage == 0 and fp.autocast_at_zero0
    if autocast:  # the module's weights stay fp32; autocast makes bf16 copies for the forward
        w = 4
    shard = k if stage >= 1 else 1
    state = {
        "weights": fp.parameters * w,
        "fp32_masters": 0 if (w == 4 and stage == 0) else 4 * t // shard,
        "optimizer_moments": 8 * t // shard,
    }
    table = math.ceil(fp.table_rows / k) * fp.table_fields * 4
    slope, fixed = fp.activations[candidate.grad_checkpointing]
    b, c, d = candidate.micro_batch, candidate.contrastive_batch, fp.embed_dim
    buckets = 2 if fp.overlap_comm else 1
    backward = {
        "activations": int(slope * b + fixed),
        # measured beside the activations (ZeRO-0/1 on 2 ranks): the gradients' storage or the
        # reduction's copy of it; ZeRO-2 keeps its partition's
        "gradients": t * w // (k if stage == 2 else 1),
        # uint8 images made the model's input: the float32 normalisation and the copy in w bytes it keeps
        "model_input": b * fp.image_bytes * (4 + w),
        "reduce_bucket": fp.reduce_bucket_size * w * buckets if stage >= 1 and fp.contiguous_gradients else 0,
        "loss_buffers": loss_buffer_bytes(fp.loss, b, c, d),
        "cached_step": 0,
    }
    if candidate.contrastive == "global" and candidate.grad_accum_steps > 1:
        per_rank = b * candidate.grad_accum_steps
        backward["cached_step"] = 2 * candidate.global_batch * d * 4 + per_rank * fp.image_bytes
    step = {
        "gradients": t * w,
        "fp32_gradients": 4 * t // shard,
        # our LAMB makes the update u of every tensor of a call in fp32 before the trust ratios
        # (optim/lamb.py): of all at ZeRO-0, of one group's partition (about its largest tensor) under ZeRO
        "optimizer_update": (4 * (t if stage == 0 else fp.largest_tensor)) if fp.optimizer == "Lamb" else 0,
    }
    on_device = sum(state.values()) + (table if fp.device == "cpu" else 0)
    transient = max(sum(backward.values()), sum(step.values()))
    return {
        **state,
        "per_sample_table": table,
        **{f"backward.{key}": value for key, value in backward.items()},
        **{f"step.{key}": value for key, value in step.items()},
        "peak": on_device + transient,
        "host": table if fp.device != "cpu" else 0,
    }


def trace_activations(
    cfg: ExperimentConfig, dtype: torch.dtype, largest: int = 256
) -> tuple[dict[bool, tuple[float, float]], dict[str, Any]]:
    """The line ``a·b + a0`` through the peak tensor bytes of a forward and backward of the bare model
    (``dtype``, train mode, the config's patch dropout), its gradients' storage already there as in
    training, without and with gradient checkpointing, at two micro-batch sizes b1 and 2·b1, b1 chosen
    so that the activations outweigh twice the peak at 2 pairs (2·b1 up to ``largest``): at a smaller
    batch the peak is the backward's transients', and the line through it would be too flat (its slope
    is at least the bytes a forward keeps per sample). With checkpointing the peak
    includes the block recomputed in the backward, which the activations kept at the forward's end do
    not show.

    The model runs on fake tensors (``FakeTensorMode``: every op's output shape and dtype, no memory and
    no arithmetic), with CPU kernels, under the exact storage count of ``tensor_memory.StorageTracker``:
    seconds for any model on any machine, the same bytes as the real run on a CPU. Also returns the
    model's facts (parameters, trainable, largest tensor, embed_dim, image shape, context length)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from eva_fastclip.models.factory import set_grad_checkpointing

    fake = FakeTensorMode()
    model, facts = _fake_model(cfg, dtype, fake)
    shape, context = facts["image_shape"], facts["context_length"]
    measure = functools.partial(_measure, model, fake, image_shape=shape, context=context, dtype=dtype)
    out: dict[bool, tuple[float, float]] = {}
    for checkpointing in (False, True):
        set_grad_checkpointing(model, checkpointing)  # on the one model: as create_model sets it
        saved, peak = measure(2)
        saved_per_sample = saved / 2
        # where the activations outweigh twice the backward's own transients (a tensor's gradient made
        # before it is added in): at a smaller batch the peak is the transients', the line too flat
        b1 = min(largest // 2, max(2, math.ceil(2 * peak / max(saved_per_sample, 1.0))))
        b2 = 2 * b1
        p1 = measure(b1)[1]
        p2 = measure(b2)[1]
        # the line through the larger point: what a forward keeps grows exactly with the batch
        slope = max(saved_per_sample, (p2 - p1) / (b2 - b1))
        out[checkpointing] = (slope, max(0.0, p2 - slope * b2))
    del model
    gc.collect()
    return out, facts


def _fake_model(cfg: ExperimentConfig, dtype: torch.dtype, fake) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The bare model in ``dtype``, train mode, its parameters and buffers fake CPU tensors, and its facts.
    Built on the meta device: no weights allocated or initialised (seconds and gigabytes for a large
    model), and none read (the checkpoints' values change no shape)."""
    from eva_fastclip.models import create_model
    from eva_fastclip.models.kernels import configure_kernels

    model_cfg = dataclasses.replace(
        cfg.model,
        grad_checkpointing=False,
        pretrained=None,
        vision_checkpoint=None,
        text_checkpoint=None,
        text_checkpoint_skip=[],
    )
    with torch.device("meta"):
        bundle = create_model(
            model_cfg,
            temperature_init=cfg.loss.temperature_init,
            logit_bias_init=cfg.loss.logit_bias_init,
            device="meta",
        )
    model = bundle.model
    configure_kernels(model, torch.device("cpu"))
    model.to(dtype=dtype).train()
    params = list(model.parameters())
    facts = {
        "parameters": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "largest_tensor": max((p.numel() for p in params if p.requires_grad), default=0),
        "embed_dim": bundle.embed_dim,
        "image_shape": bundle.image_shape,
        "context_length": _context_length(model),
    }
    _to_fake(model, fake)
    return model, facts


def _to_fake(model: torch.nn.Module, fake) -> None:
    """Replace the model's meta parameters and buffers by fake CPU tensors of the same shapes (in place: a
    checkpointed block recomputes with the module's own parameters in the backward)."""
    cpu = torch.device("cpu")

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        return fake.fake_tensor_converter.from_meta_and_device(fake, t, cpu)

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    to_fake(param.detach()), requires_grad=param.requires_grad
                )
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = to_fake(buffer)


def _context_length(model: torch.nn.Module) -> int:
    length = getattr(model, "context_length", None)
    if length is None:  # a Hugging Face text tower
        length = model.text.config.max_position_embeddings
    return int(length)


def _measure(model, fake, batch: int, *, image_shape, context: int, dtype) -> tuple[float, float]:
    """A forward and backward of ``batch`` pairs on fake tensors: the bytes live at the forward's end
    (kept for the backward) and the peak, both above what was there before."""
    with fake:
        for p in model.parameters():  # there before, as in training after the first step: not counted
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        images = torch.rand(batch, *image_shape).to(dtype)
        tokens = torch.randint(1, 1000, (batch, context))
        with StorageTracker(keep_peak_tensors=False) as tracker:
            loss = _forward(model, images, tokens)
            saved = tracker.current
            loss.backward()
        peak = tracker.peak
        del loss
        for p in model.parameters():
            p.grad = None
    return float(saved), float(peak)


def _forward(model, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    image_features, text_features = model(images, tokens)[:2]
    return (image_features.float() * text_features.float()).sum()
