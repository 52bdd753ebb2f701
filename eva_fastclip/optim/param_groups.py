"""Optimizer parameter groups as EVA-CLIP builds them: per-tower lr and weight decay, layer-wise lr decay.

Layer ids follow EVA-CLIP's ``get_layer_id``: in a tower with L blocks the embeddings are layer 0, block i is
layer i + 1 and everything after the blocks (final norm, pooling, projection) is layer L + 1. A parameter
at layer l gets ``tower_lr * layer_decay ** (L + 1 - l)``: the head trains at the tower's lr, the
embeddings at the most decayed one. ``optim.weight_decay_rule`` picks the tensors that get weight
decay (``decays``): ours, FastCLIP's (OpenCLIP's) or EVA-CLIP's; the temperature never gets any.

There is one group per (tower, layer, decay or not), not one per lr value, as in EVA-CLIP: under ZeRO
DeepSpeed flattens each group, and with ``optim.lamb_trust_ratio: per_zero_partition`` (FusedLamb's rule)
LAMB's trust ratio is taken per flattened partition, which per-layer groups keep close to per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from eva_fastclip.config import OptimConfig

# no_embeddings: substrings of names that are embeddings or the temperature, never decayed.
_NO_DECAY_NAMES = ("logit_scale", "logit_bias", "embedding", "pos_embed", "cls_token", "class_embedding")
# fastclip: FastCLIP's main.py (as OpenCLIP's) decays no name holding one of these, nor 1-D tensors.
_FASTCLIP_NO_DECAY_PARTS = ("bn", "ln", "bias")
# eva_clip: EVA-CLIP's towers list these in no_weight_decay() (EVA ViT: pos_embed, cls_token; open_clip ViT:
# positional_embedding, class_embedding; text: positional_embedding, its token embedding is decayed).
_EVA_CLIP_NO_DECAY = frozenset(
    {
        "visual.trunk.pos_embed",
        "visual.trunk.cls_token",
        "visual.positional_embedding",
        "visual.class_embedding",
        "text.positional_embedding",
        "positional_embedding",  # CLIP's built-in text tower
    }
)
_TEMPERATURE_NAMES = ("logit_scale", "logit_bias")

#: Name of the temperature's own group; build_scheduler keeps this group's lr constant.
TEMPERATURE_GROUP = "temperature"
TOWERS = ("visual", "text")
# open_clip's CLIP keeps its text tower at the top level rather than under ``text.``.
_BUILTIN_TEXT = ("token_embedding", "positional_embedding", "transformer", "ln_final", "text_projection")


@dataclass(frozen=True)
class _Layout:
    """A tower layout we know: the dotted path of its block list and of its layer-0 (embedding) parts."""

    blocks: str
    embeddings: tuple[str, ...]
    what: str


# Tried in order; paths are from the CLIP model's root. The number of blocks is read from the module.
_LAYOUTS: dict[str, tuple[_Layout, ...]] = {
    "visual": (
        _Layout(
            "visual.transformer.resblocks",
            ("visual.conv1", "visual.class_embedding", "visual.positional_embedding", "visual.ln_pre"),
            "open_clip VisionTransformer",
        ),
        _Layout(
            "visual.trunk.blocks",
            (
                "visual.trunk.patch_embed",
                "visual.trunk.cls_token",
                "visual.trunk.reg_token",
                "visual.trunk.pos_embed",
                "visual.trunk.norm_pre",  # timm's pre-block norm, open_clip's ln_pre
            ),
            "timm ViT / Eva trunk",
        ),
    ),
    "text": (
        _Layout(
            "text.transformer.resblocks",
            ("text.token_embedding", "text.positional_embedding", "text.cls_emb"),
            "open_clip TextTransformer",
        ),
        _Layout("text.transformer.encoder.layer", ("text.transformer.embeddings",), "Hugging Face encoder"),
        _Layout("transformer.resblocks", ("token_embedding", "positional_embedding"), "CLIP's built-in text"),
    ),
}


def decays(name: str, param: nn.Parameter, rule: str = "no_embeddings") -> bool:
    """Whether ``optim.weight_decay_rule`` ``rule`` decays this tensor; 1-D tensors (biases, norm gains)
    and the temperature never.

    - ``no_embeddings``: matrices, but not embeddings, position embeddings or class tokens;
    - ``fastclip``: every tensor whose name holds none of bn, ln, bias (FastCLIP's and OpenCLIP's rule);
    - ``eva_clip``: every tensor but ``*.bias`` and the towers' position embeddings and class tokens.
    """
    if param.ndim < 2 or name in _TEMPERATURE_NAMES:
        return False
    if rule == "no_embeddings":
        return not any(part in name for part in _NO_DECAY_NAMES)
    if rule == "fastclip":
        return not any(part in name for part in _FASTCLIP_NO_DECAY_PARTS)
    if rule == "eva_clip":
        return not name.endswith(".bias") and name not in _EVA_CLIP_NO_DECAY
    raise ValueError(f"optim.weight_decay_rule={rule!r} is unknown")


def tower_of(name: str) -> str | None:
    """ "visual", "text", or None for parameters of neither tower (logit_scale, logit_bias, ...)."""
    head = name.split(".", 1)[0]
    if head == "visual":
        return "visual"
    if head == "text" or head in _BUILTIN_TEXT:
        return "text"
    return None


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@dataclass(frozen=True)
class TowerLayers:
    """Layer ids of one tower: L = ``num_blocks``; ``layout`` None when the tower is not read in layers."""

    layout: _Layout | None
    num_blocks: int
    block_index: dict[str, int]  # child name in the block list -> its position

    def layer_id(self, name: str) -> int | None:
        if self.layout is None:
            return None
        if _under(name, self.layout.blocks):
            child = name[len(self.layout.blocks) + 1 :].split(".", 1)[0]
            return self.block_index[child] + 1
        if any(_under(name, e) for e in self.layout.embeddings):
            return 0
        return self.num_blocks + 1


def tower_layers(model: nn.Module, tower: str, names: set[str]) -> TowerLayers | str:
    """How ``tower`` (whose parameter names are ``names``) splits into layers, or why it cannot be read."""
    for layout in _LAYOUTS[tower]:
        try:
            blocks = model.get_submodule(layout.blocks)
        except AttributeError:
            continue
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
            continue
        if not any(_under(n, layout.blocks) for n in names):
            continue  # the list is there but holds none of this tower's parameters
        unknown = _before_blocks(model, layout, names)
        if unknown:
            return (
                f"{layout.what} at {layout.blocks} has parameters before its blocks that are not known "
                f"embeddings ({', '.join(unknown[:4])}): their layer id would be a guess"
            )
        index = {child: i for i, (child, _) in enumerate(blocks.named_children())}
        return TowerLayers(layout, len(blocks), index)
    known = ", ".join(f"{layout.blocks} ({layout.what})" for layout in _LAYOUTS[tower])
    return f"no block list found; known layouts: {known}"


def _before_blocks(model: nn.Module, layout: _Layout, names: set[str]) -> list[str]:
    """This tower's parameters in modules registered before the blocks (on the path down to them) that
    are not listed embeddings: a layout we do not know, which must not silently land in layer L + 1."""
    parts = layout.blocks.split(".")
    unknown = []
    for depth in range(len(parts)):
        parent_path = ".".join(parts[:depth])
        for child_name, child in model.get_submodule(parent_path).named_children():
            if child_name == parts[depth]:
                break
            prefix = f"{parent_path}.{child_name}" if parent_path else child_name
            for name, _ in child.named_parameters(prefix=prefix):
                if name in names and not any(_under(name, e) for e in layout.embeddings):
                    unknown.append(name)
    return unknown


def parameter_groups(
    model: nn.Module, optim: OptimConfig, temperature_lr: float | None = None
) -> list[dict[str, Any]]:
    """Groups named like ``visual.layer_03.decay`` with their own peak ``lr`` and ``weight_decay``.

    Frozen parameters are left out, empty groups dropped. Parameters of neither tower go to
    ``other.decay`` / ``other.no_decay`` at ``optim.lr``. A learned temperature (logit_scale) is alone in
    its group, without decay and with ``trust_ratio`` = ``optim.temperature_trust_ratio`` (build_optimizer
    turns that into LAMB's per-group trust-ratio bounds): the group ``temperature`` at the constant
    ``temperature_lr`` when given (FastCLIP-v3 steps tau by its own group), else ``other.temperature`` at
    ``optim.lr``. A tower whose layout cannot be read is an error when its layer decay is not 1; with decay
    1 it gets one lr anyway, and its groups are ``visual.decay`` / ``visual.no_decay``.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    tower_lr = {t: _or(getattr(optim, f"{t}_lr"), optim.lr) for t in TOWERS}
    tower_wd = {t: _or(getattr(optim, f"{t}_weight_decay"), optim.weight_decay) for t in TOWERS}
    layer_decay = {t: getattr(optim, f"{t}_layer_decay") for t in TOWERS}

    layers: dict[str, TowerLayers] = {}
    for tower in TOWERS:
        if not any(tower_of(n) == tower for n, _ in named):
            continue
        # the layout from all of the tower's parameters: a locked tower may leave only its head trainable
        names = {n for n, _ in model.named_parameters() if tower_of(n) == tower}
        found = tower_layers(model, tower, names)
        if isinstance(found, str):
            if layer_decay[tower] != 1.0:
                module = getattr(model, tower, model)  # CLIP's built-in text tower is the model itself
                raise ValueError(
                    f"optim.{tower}_layer_decay={layer_decay[tower]} needs the layers of the {tower} tower "
                    f"({type(module).__name__}), but {found}; set optim.{tower}_layer_decay=1.0 for this "
                    "architecture"
                )
            found = TowerLayers(None, 0, {})
        layers[tower] = found

    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in named:
        tower = tower_of(name)
        decay = decays(name, param, optim.weight_decay_rule)
        kind = "decay" if decay else "no_decay"
        if tower is None and name == "logit_scale":
            own_lr = temperature_lr is not None
            key: tuple = (2, 0, 0) if own_lr else (1, 2, 0)
            spec = {
                "name": TEMPERATURE_GROUP if own_lr else "other.temperature",
                "lr": temperature_lr if own_lr else optim.lr,
                "weight_decay": 0.0,
                "trust_ratio": optim.temperature_trust_ratio,
            }
        elif tower is None:
            key = (1, 0, int(not decay))
            spec = {
                "name": f"other.{kind}",
                "lr": optim.lr,
                "weight_decay": optim.weight_decay if decay else 0.0,
            }
        else:
            towers = layers[tower]
            layer = towers.layer_id(name)
            depth = 0 if layer is None else towers.num_blocks + 1 - layer
            spec = {
                "name": f"{tower}.{kind}" if layer is None else f"{tower}.layer_{layer:02d}.{kind}",
                "lr": tower_lr[tower] * layer_decay[tower] ** depth,
                "weight_decay": tower_wd[tower] if decay else 0.0,
                "layer_id": layer,
            }
            key = (0, TOWERS.index(tower), -1 if layer is None else layer, int(not decay))
        groups.setdefault(key, {**spec, "params": []})["params"].append(param)
    # sorted: visual then text by layer, then the other parameters, the temperature last
    return [groups[k] for k in sorted(groups)]


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
