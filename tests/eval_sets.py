"""Tiny evaluation sets on disk for the evaluation tests, in clip_benchmark's webdataset layout, and a fake
CLIP whose image features are written into the images' pixels, so every score can be worked out by hand.

An image is one row of grey pixels: pixel j holds feature j as 128 + 40·v (v a multiple of 0.05 in
[-3, 3]), and ``vector_preprocess`` reads the vector back exactly. ``FakeModel.encode_image`` returns
it; ``encode_text`` maps "... class{c}." prompts and free captions to fixed vectors (see FakeModel).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from eva_fastclip.data import write_shard

DIM = 7
TEMPLATES = ["a photo of a {c}.", "a drawing of a {c}."]


def vector_png(vector) -> bytes:
    values = np.round(128 + 40 * np.asarray(vector, dtype=np.float64))
    assert values.min() >= 0 and values.max() <= 255, "a feature outside [-3.2, 3.175] does not fit a pixel"
    pixels = values.astype(np.uint8)[None, :]
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def vector_preprocess(image: Image.Image) -> Tensor:
    return (torch.tensor(np.asarray(image)[0, :, 0], dtype=torch.float64) - 128).float() / 40


def npy_bytes(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array))
    return buffer.getvalue()


def write_classification_folder(
    root: Path,
    vectors,
    labels,
    classnames: list[str],
    *,
    per_shard: int = 5,
    metadata=None,
    templates: list[str] = TEMPLATES,
) -> Path:
    """clip_benchmark's layout: test/{0..n-1}.tar ({key}.png, {key}.cls[, {key}.npy]), test/nshards.txt,
    classnames.txt, zeroshot_classification_templates.txt."""
    (root / "test").mkdir(parents=True, exist_ok=True)
    samples = []
    for i, (vector, label) in enumerate(zip(vectors, labels)):
        sample = {"__key__": f"s{i:07d}", "png": vector_png(vector), "cls": str(int(label))}
        if metadata is not None:
            sample["npy"] = npy_bytes(metadata[i])
        samples.append(sample)
    chunks = [samples[i : i + per_shard] for i in range(0, len(samples), per_shard)]
    for n, chunk in enumerate(chunks):
        write_shard(root / "test" / f"{n}.tar", chunk)
    (root / "test" / "nshards.txt").write_text(f"{len(chunks)}\n")
    (root / "classnames.txt").write_text("\n".join(classnames) + "\n")
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    return root


def write_retrieval_folder(root: Path, vectors, captions: list[list[str]], *, per_shard: int = 4) -> Path:
    """clip_benchmark's retrieval layout: {key}.png + {key}.txt (one caption a line), dataset_type.txt."""
    (root / "test").mkdir(parents=True, exist_ok=True)
    samples = [
        {"__key__": f"s{i:07d}", "png": vector_png(vector), "txt": "\n".join(lines)}
        for i, (vector, lines) in enumerate(zip(vectors, captions))
    ]
    chunks = [samples[i : i + per_shard] for i in range(0, len(samples), per_shard)]
    for n, chunk in enumerate(chunks):
        write_shard(root / "test" / f"{n}.tar", chunk)
    (root / "test" / "nshards.txt").write_text(f"{len(chunks)}\n")
    (root / "dataset_type.txt").write_text("retrieval\n")
    return root


CAPTIONS: dict[str, list[float]] = {}
"""Free captions a test registers with their text vector (FakeModel.encode_text)."""


def fake_tokenize(texts: list[str]) -> Tensor:
    """One row per text: [kind, a, b]. A prompt "... class{c}." with template t: [0, c, t]; a caption
    registered in CAPTIONS: [1, its number, 0]."""
    rows = []
    for text in texts:
        if text in CAPTIONS:
            rows.append([1, list(CAPTIONS).index(text), 0])
            continue
        template = next(t for t, pattern in enumerate(TEMPLATES) if text.startswith(pattern.split("{c}")[0]))
        rows.append([0, int(text.split("class")[1].rstrip(".")), template])
    return torch.tensor(rows)


class FakeModel(nn.Module):
    """Images are their feature vectors. Prompt (c, t) encodes to (1 + c)·(e_c ± e_last) (+ for template
    0): averaging the normalised embeddings over both templates cancels e_last, so the classifier is
    exactly the one-hot class directions. A registered caption encodes to its vector. Records the
    training flag each call ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # gives the model a dtype; unused otherwise
        self.tower = nn.Linear(1, 1)  # a submodule whose training flag must be restored too
        self.seen_training: list[bool] = []

    def encode_image(self, images: Tensor) -> Tensor:
        self.seen_training.append(self.training or self.tower.training)
        return images

    def encode_text(self, tokens: Tensor) -> Tensor:
        self.seen_training.append(self.training or self.tower.training)
        out = torch.zeros(len(tokens), DIM)
        for row, (kind, a, b) in enumerate(tokens.tolist()):
            if kind == 1:
                vector = torch.tensor(list(CAPTIONS.values())[a])
                out[row, : len(vector)] = vector
            else:
                out[row] = F.one_hot(torch.tensor(a), DIM).float() * (1.0 + a)
                out[row, -1] = (1.0 if b == 0 else -1.0) * (1.0 + a)
        return out
