"""Read the tensors of a local weights file, whatever wraps them; the one reader for every tower loader.

Accepted: OpenAI's TorchScript archives, ``.safetensors``, and ``torch.save`` files holding a state dict,
possibly wrapped (``model_ema`` / ``model`` / ``module`` / ``state_dict``, as timm unwraps them;
open_clip_train saves ``{"state_dict": ...}``) and with ``module.`` (DDP, DeepSpeed) or ``_orig_mod.``
(torch.compile) key prefixes. ``torch.load`` runs with ``weights_only=True``: an arbitrary pickle could
run code, so it is refused with a message that says how to re-save the file.
"""

from __future__ import annotations

import argparse
import importlib.util
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

WRAPPER_KEYS = ("model_ema", "model", "module", "state_dict")
KEY_PREFIXES = ("module.", "_orig_mod.")


@dataclass
class WeightsFile:
    tensors: dict[str, torch.Tensor]
    container: str
    """"TorchScript archive", "safetensors" or "torch.save"."""
    wrappers: list[str] = field(default_factory=list)
    """The wrapper keys that were unwrapped, outermost first."""

    def describe(self) -> str:
        return self.container + (f" in {'/'.join(self.wrappers)}" if self.wrappers else "")


def is_torchscript(path: Path) -> bool:
    # torch.save files are zip archives too; only TorchScript ones hold constants.pkl
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") for name in archive.namelist())


def read_weights(path: str | Path) -> WeightsFile:
    """The tensors of ``path`` with wrappers and key prefixes removed; ValueError naming the file if not."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"weights file {path} does not exist")
    wrappers: list[str] = []
    if is_torchscript(path):
        obj: object = dict(torch.jit.load(str(path), map_location="cpu").state_dict())
        container = "TorchScript archive"
    elif path.suffix == ".safetensors":
        if importlib.util.find_spec("safetensors") is None:
            raise ValueError(f"{path} is a .safetensors file but the safetensors package is not installed")
        from safetensors.torch import load_file

        obj, container = load_file(str(path), device="cpu"), "safetensors"
    else:
        try:  # argparse.Namespace: training scripts often store their arguments beside the weights
            with torch.serialization.safe_globals([argparse.Namespace]):
                obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(
                f"cannot read {path} with torch.load(weights_only=True): {err}. If the file is trusted, "
                "re-save its state dict: torch.save(torch.load(p, weights_only=False)['model'], 'weights.pt')"
            ) from err
        container = "torch.save"
    while isinstance(obj, Mapping):
        inner = next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), Mapping) and obj[k]), None)
        if inner is None:
            break
        wrappers.append(inner)
        obj = obj[inner]
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict")
    tensors = {}
    for key, value in obj.items():
        if isinstance(key, str) and isinstance(value, torch.Tensor):
            while key.startswith(KEY_PREFIXES):
                key = key.split(".", 1)[1]
            tensors[key] = value
    if not tensors:
        raise ValueError(f"{path} holds no tensors (top-level keys: {list(obj)[:8]})")
    return WeightsFile(tensors, container, wrappers)
