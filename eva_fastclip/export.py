"""Export a training checkpoint as an fp32 open_clip state dict, loadable by open_clip.create_model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from eva_fastclip.engine import checkpoint
from eva_fastclip.models import to_open_clip_state_dict


def read_client_state(folder: Path) -> dict[str, Any]:
    """Our client state (step, config, ...) from a DeepSpeed checkpoint folder, read without an engine."""
    states = sorted(folder.glob("mp_rank_*_model_states.pt"))
    if not states:
        raise FileNotFoundError(f"{folder} holds no DeepSpeed model states (mp_rank_*_model_states.pt)")
    return torch.load(states[0], map_location="cpu", weights_only=False)


def consolidated_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights of a complete checkpoint, merged from the ZeRO partitions of every rank."""
    if not checkpoint.is_complete(folder):
        raise ValueError(f"{folder} has no {checkpoint.MARKER}: its save never finished; pick a complete one")
    state = read_client_state(folder)
    merged: dict[str, torch.Tensor] = {}
    if state.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        merged = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    # the rest from the saved module: all of it at stage 0 (stored whole), and under ZeRO-1 the frozen
    # parameters (a fixed temperature, a locked text tower), of which it keeps no fp32 copy, not even the
    # shapes: they never change, so the module's copy is the trained value
    for key, value in state["module"].items():
        merged.setdefault(key, value.float())
    return merged


def export_open_clip(folder: Path, output: Path, verify: bool = True) -> dict[str, Any]:
    """Write ``output`` and, with ``verify``, first load it into open_clip with strict keys: a file that
    open_clip would not load never appears at ``output`` (it is written under a temporary name, then
    renamed)."""
    state_dict = to_open_clip_state_dict(consolidated_state_dict(folder))
    model_cfg = read_client_state(folder)["config"]["model"]
    arch = model_cfg["name"]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    torch.save(state_dict, tmp)
    try:
        if verify:
            _verify_open_clip_load(tmp, arch, model_cfg.get("text_hf_model"))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, output)
    return {"output": str(output), "architecture": arch, "tensors": len(state_dict)}


def _verify_open_clip_load(path: Path, arch: str, text_hf_model: str | None) -> None:
    import open_clip

    from eva_fastclip.models import text_towers  # (also registers the shipped architectures)

    # a Hugging Face text tower is not part of the architecture's name: rebuild it from its folder
    kwargs = (
        text_towers.hf_text_model_kwargs(arch, text_hf_model, load_weights=False) if text_hf_model else {}
    )
    open_clip.create_model(arch, pretrained=str(path), **kwargs)  # strict: raises on an unmatched key
