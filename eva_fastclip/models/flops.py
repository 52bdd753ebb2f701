"""The model FLOPs of one training sample, counted from the model's own modules as it runs.

Convention (PaLM's model FLOPs utilization, Megatron-LM's "model FLOPs"): a multiply-accumulate is 2 FLOPs
and only matrix products count, those of

- every ``nn.Linear`` and convolution, from its weight's shape and the tokens (or output positions) it
  is applied to: 2 · in_features · out_features per token, 2 · (C_in / groups) · k_h · k_w · C_out per
  output position;
- every attention module, counted whole (nn.MultiheadAttention applies its weights as tensors, timm's EVA
  its fused qkv through ``F.linear``: their Linear children are not all called): its projections (q, k, v
  and output, each over the tokens it sees) and its two matmuls, QKᵀ and AV, which no module holds,
  2 · 2 · L_q · L_k · (heads · head_dim) — the full L_q x L_k square even under a causal mask (the text
  tower's mask is an explicit tensor: its kernels compute the square);
- the towers' projections kept as bare matrices (open_clip's ``visual.proj``, ``text_projection``): 2 ·
  width · embed_dim per sample.

Elementwise work (norms, activations, softmax, RoPE, residual adds, biases), embedding lookups and the loss
are left out: under 1% of a ViT-B's FLOPs. Training counts the forward three times (backward = 2 x
forward: the gradients of the inputs and of the weights), whatever the run recomputes: gradient
checkpointing's second forward and ``train.contrastive_batch=global``'s no-grad forward are hardware FLOPs,
not model FLOPs. A frozen module (``model.lock_text``) counts its forward once: no backward runs through it.

The count is the model as run: each module's hook reads the shapes of one forward of the model, in
training mode, on the meta device (no weights, no arithmetic: about 1 s for ViT-B-16, 3 s for ViT-L-14 on
a 2-core CPU, once per process and architecture): the vision tower sees only the tokens its patch dropout
keeps (``max(1, int(L·(1 − p)))`` of the L patches, plus the class token), the text tower its whole
context. The count is exact where every matrix product of the model
sits in a Linear, a convolution, one of the attention modules recognised here (``nn.MultiheadAttention``,
open_clip's ``AttentionPool2d`` of the RN towers, and any module holding ``num_heads`` and ``head_dim``:
timm's ``Attention`` and ``EvaAttention``, open_clip's ``Attention``; Hugging Face's ``num_attention_heads``
and ``attention_head_size``) or a bare projection: open_clip's ViTs and text transformers, its ModifiedResNet
(RN50, attention pool included) and timm's EVA trunks. tests/test_flops.py checks it against
``torch.utils.flop_counter.FlopCounterMode`` on real forwards and backwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator

import torch
from torch import nn

from eva_fastclip.config import ModelConfig

#: 2-D parameters used as a bare matrix on one pooled token per sample (open_clip's towers' projections)
BARE_PROJECTIONS = ("proj", "text_projection")
#: a training step's FLOPs per forward FLOP of a trained module (forward + backward: PaLM's, Megatron's)
TRAINING_FACTOR = 3


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """FLOPs of one sample through each tower: forward, and a training step's (forward + backward)."""

    vision_forward: float
    text_forward: float
    vision_training: float
    text_training: float

    @property
    def forward(self) -> float:
        return self.vision_forward + self.text_forward

    @property
    def training(self) -> float:
        """Model FLOPs of one training sample: what MFU divides by the peak."""
        return self.vision_training + self.text_training

    def describe(self) -> str:
        return (
            f"{self.training / 1e9:.4g} GFLOP per training sample (vision {self.vision_training / 1e9:.4g}, "
            f"text {self.text_training / 1e9:.4g}; forward {self.forward / 1e9:.4g})"
        )


class _Count:
    """FLOPs per tower of the traced forward, forward and training (:func:`count_flops`'s hooks)."""

    def __init__(self) -> None:
        self.forward = {"vision": 0.0, "text": 0.0}
        self.training = {"vision": 0.0, "text": 0.0}
        self.inside = 0  # > 0 inside an attention module, which counts its own Linear children

    def add(self, tower: str, flops: float, module: nn.Module) -> None:
        trained = any(p.requires_grad for p in module.parameters())
        self.forward[tower] += flops
        self.training[tower] += flops * (TRAINING_FACTOR if trained else 1)


def _tower(name: str) -> str:
    return "vision" if name == "visual" or name.startswith("visual.") else "text"


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, kwargs.get("hidden_states"), kwargs.get("x"), kwargs.get("query")):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _matrices(module: nn.Module) -> int:
    """Entries of the weight matrices an attention module applies to each of its tokens: its own 2-D
    parameters (open_clip's fused ``in_proj_weight``) and its Linear descendants' weights."""
    own = sum(p.numel() for p in module.parameters(recurse=False) if p.ndim == 2)
    return own + sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def _heads(module: nn.Module) -> int | None:
    """heads x head_dim of a self-attention module, or None for any other module."""
    heads = getattr(module, "num_heads", getattr(module, "num_attention_heads", None))
    head_dim = getattr(module, "head_dim", getattr(module, "attention_head_size", None))
    if isinstance(heads, int) and isinstance(head_dim, int):
        return heads * head_dim
    return None


def _multihead_flops(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> float:
    """nn.MultiheadAttention: q over L_q tokens, k and v over L_k, the output over L_q, QKᵀ and AV."""
    query = args[0] if args else kwargs["query"]
    key = args[1] if len(args) > 1 else kwargs.get("key", query)
    if query.ndim == 2:  # unbatched
        batch, lq, lk = 1, query.shape[0], key.shape[0]
    elif module.batch_first:
        batch, lq, lk = query.shape[0], query.shape[1], key.shape[1]
    else:
        batch, lq, lk = query.shape[1], query.shape[0], key.shape[0]
    e = module.embed_dim
    projections = lq * e * e + lk * e * (module.kdim + module.vdim) + lq * module.out_proj.weight.numel()
    return 2.0 * batch * (projections + 2 * lq * lk * e)


def _pool2d_flops(module: nn.Module, args: tuple) -> float:
    """open_clip's AttentionPool2d (RN towers): all H·W + 1 tokens attend and are projected, of which the
    forward keeps the first."""
    x = args[0]
    batch, tokens = x.shape[0], x.shape[2] * x.shape[3] + 1
    width = module.q_proj.out_features
    return 2.0 * batch * (tokens * _matrices(module) + 2 * tokens * tokens * width)


def _attention_flops(module: nn.Module, args: tuple, kwargs: dict) -> float | None:
    """The FLOPs of one call of an attention module, or None when ``module`` is none."""
    from open_clip.modified_resnet import AttentionPool2d

    if isinstance(module, nn.MultiheadAttention):
        return _multihead_flops(module, args, kwargs)
    if isinstance(module, AttentionPool2d):
        return _pool2d_flops(module, args)
    width = _heads(module)
    x = _first_tensor(args, kwargs)
    if width is None or x is None or x.ndim != 3:
        return None
    batch, tokens = x.shape[0], x.shape[1]
    return 2.0 * batch * (tokens * _matrices(module) + 2 * tokens * tokens * width)


def _is_attention(module: nn.Module) -> bool:
    from open_clip.modified_resnet import AttentionPool2d

    return isinstance(module, (nn.MultiheadAttention, AttentionPool2d)) or _heads(module) is not None


def _without_meta_mask(module: nn.Module, args: tuple, kwargs: dict):
    """Hugging Face models read their attention mask's values (a batch without padding skips it), which a
    meta tensor does not have; the mask changes no matrix product's shape, so the meta forward leaves it
    out."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.is_meta:
        return args, {**kwargs, "attention_mask": None}
    return None


def _is_hugging_face_model(module: nn.Module) -> bool:
    """By the class's ancestry: ``transformers.PreTrainedModel`` itself is a lazy attribute whose first
    access imports its modeling code (1.8 s), in every process that counts a model without one."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


@contextlib.contextmanager
def _hooks(model: nn.Module, count: _Count) -> Iterator[None]:
    """Forward hooks that add each Linear's, convolution's and attention module's FLOPs to ``count``."""
    handles = []

    def leaf(tower: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if count.inside or not isinstance(output, torch.Tensor):
                return
            if isinstance(module, nn.Linear):
                flops = 2.0 * output.numel() * module.in_features
            else:  # a convolution: per output position, C_in/groups x kernel taps x C_out
                flops = 2.0 * output.numel() * module.weight[0].numel()
            count.add(tower, flops, module)

        return hook

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not count.inside:
            flops = _attention_flops(module, args, kwargs)
            if flops is not None:
                count.add(tower_of[module], flops, module)
        count.inside += 1

    def leave(module: nn.Module, args: tuple, output) -> None:
        count.inside -= 1

    tower_of = {}
    for name, module in model.named_modules():
        tower_of[module] = _tower(name)
        if _is_hugging_face_model(module):
            handles.append(module.register_forward_pre_hook(_without_meta_mask, with_kwargs=True))
        if _is_attention(module):
            handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            handles.append(module.register_forward_hook(leave))
        elif isinstance(module, nn.Linear) or (
            isinstance(module, nn.modules.conv._ConvNd) and not module.transposed
        ):
            handles.append(module.register_forward_hook(leaf(_tower(name))))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def count_flops(model: nn.Module, images: torch.Tensor, tokens: torch.Tensor) -> ModelFlops:
    """The FLOPs per sample of ``model(images, tokens)`` as it runs now (its mode, its patch dropout), from
    one forward without autograd on any device (the meta device: shapes only)."""
    count = _Count()
    with torch.no_grad(), _hooks(model, count):
        model(images, tokens)
    batch = images.shape[0]
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1] in BARE_PROJECTIONS and param.ndim == 2:
            tower, flops = _tower(name), 2.0 * param.numel() * batch
            count.forward[tower] += flops
            count.training[tower] += flops * (TRAINING_FACTOR if param.requires_grad else 1)
    return ModelFlops(
        vision_forward=count.forward["vision"] / batch,
        text_forward=count.forward["text"] / batch,
        vision_training=count.training["vision"] / batch,
        text_training=count.training["text"] / batch,
    )


class _OpenClipNotes(logging.Filter):
    """open_clip's notes on the root logger while the copy is built (its fresh weights, its transforms):
    the run's own model made them already."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "open_clip" not in record.pathname


def model_flops(cfg: ModelConfig, patch_dropout: float | None = None) -> ModelFlops:
    """The FLOPs per sample of the model ``cfg`` describes, in training (``patch_dropout``: the run's
    masking, if not ``cfg.patch_dropout``), counted on a copy of it on the meta device, where no weights
    exist (a forward that needs a tensor's values there is counted on a CPU copy with fresh weights
    instead). No checkpoint is read, and the run's random generators are left as they were. Cached per
    architecture and masking: a process may build several Trainers (tests, tune's probes)."""
    key = (
        cfg.name,
        cfg.text_hf_model,
        cfg.lock_text,
        cfg.patch_dropout if patch_dropout is None else patch_dropout,
    )
    return _model_flops(*key)


@functools.lru_cache(maxsize=16)
def _model_flops(name: str, text_hf_model: str | None, lock_text: bool, patch_dropout: float) -> ModelFlops:
    cfg = ModelConfig(
        name=name, text_hf_model=text_hf_model, lock_text=lock_text, patch_dropout=patch_dropout
    )
    try:
        return _count_copy(cfg, torch.device("meta"))
    except (RuntimeError, NotImplementedError):  # a value asked for (.item()): count a CPU copy
        return _count_copy(cfg, torch.device("cpu"))


def _count_copy(cfg: ModelConfig, device: torch.device, batch: int = 2) -> ModelFlops:
    from eva_fastclip.models.factory import create_model

    quiet = _OpenClipNotes()
    logging.getLogger().addFilter(quiet)
    try:
        with torch.random.fork_rng(devices=[]), device:
            bundle = create_model(cfg, device=device)
            model = bundle.model.train()
            context = getattr(bundle.tokenizer, "context_length", None) or _context_length(model)
            images = torch.zeros(batch, *bundle.image_shape)
            tokens = torch.ones(batch, context, dtype=torch.long)
            return count_flops(model, images, tokens)
    finally:
        logging.getLogger().removeFilter(quiet)


def _context_length(model: nn.Module) -> int:
    length = getattr(model, "context_length", None)
    if length is None:  # a Hugging Face text tower
        length = model.text.config.max_position_embeddings
    return int(length)
