"""Two optimizer steps of 2 micro-batches each, with fixed pairs, through the real Trainer: the layouts that
tests/test_accumulation.py and tests/launched/test_accumulation_two_ranks.py compare. On 2 ranks
(:func:`two_ranks`, a piece of tests/launched/two_rank_suite.py) every rank saves what it holds after the
steps to ``OUT/<loss>_rank<K>.pt``.

Micro-batch t of a step is POOL pairs; on K ranks rank k takes its k-th slice of them, so K ranks x POOL/K
pairs and 1 rank x POOL pairs put the same pairs in every loss evaluation (the contrastive batch).
"""

import json
import os
from pathlib import Path

import torch

from eva_fastclip.config import load_config
from eva_fastclip.engine.build import build_trainer
from eva_fastclip.engine.trainer import Trainer

POOL, DATASET, ACCUM, STEPS = 8, 32, 2, 2
LOSSES = ("fastclip_v3", "fastclip_v2")  # the global tau (rgcl_g) and the individual tau_i (RGCL)


def step_pairs() -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """STEPS steps of ACCUM micro-batches of POOL pairs; step 2 draws step 1's samples again in another
    order, so it reads the u (and tau_i) that step 1 committed."""
    g = torch.Generator().manual_seed(0)
    first = torch.randperm(DATASET, generator=g)[: POOL * ACCUM]
    steps = []
    for order in (first, first[torch.randperm(len(first), generator=g)]):
        steps.append(
            [
                (
                    torch.randn(POOL, 3, 32, 32, generator=g),
                    torch.randint(1, 49000, (POOL, 16), generator=g),
                    order[t * POOL : (t + 1) * POOL],
                )
                for t in range(ACCUM)
            ]
        )
    return steps


class StandIn:
    """A loader the Trainer accepts; the micro-batches are fed to train_step by hand."""

    num_batches, dataset_size, num_samples = STEPS * ACCUM, DATASET, DATASET

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        return iter(())


def make_trainer(out: Path, loss: str, micro: int, accum: int = ACCUM) -> Trainer:
    ds = json.loads(Path("ds_configs/zero1_fp32_lamb.json").read_text())
    cfg = load_config(
        "configs/toy.json",
        [
            "model.name=test-vit-xs",
            f"loss.name={loss}",
            f"train.batch_size={micro}",
            f"train.grad_accum_steps={accum}",
            f"train.steps={STEPS}",
            f"train.output_dir={out}",
            "optim.warmup_steps=0",
            "eval.zeroshot_dir=null",
            "eval.retrieval_shards=null",
        ],
    )
    return build_trainer(cfg, ds, loader=StandIn())


def run(trainer: Trainer, steps, order=tuple(range(ACCUM)), micro_batches=None) -> dict:
    """Feed each step's micro-batches (this rank's slice of each, in ``order``); return what the rank holds:
    every weight (the temperature's too) and its rows of the per-sample table."""
    rank, world = trainer.rank, trainer.world_size
    for epoch, pairs in enumerate(steps):  # step 2 in epoch 1: gamma < 1, u mixes in step 1's value
        trainer.loss.set_epoch(epoch)
        batches = micro_batches(pairs) if micro_batches else [pairs[t] for t in order]
        for i, (images, tokens, indices) in enumerate(batches):
            own = slice(rank * len(indices) // world, (rank + 1) * len(indices) // world)
            metrics = trainer.train_step(images[own], tokens[own], indices[own])
            assert (metrics is None) == (i < len(batches) - 1)  # one optimizer step per step's pairs
            if metrics is not None:
                assert metrics["step_applied"] == 1.0
    state = trainer.loss.state
    weights = {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}
    return {
        "weights": weights,
        "lo": state.lo,
        "table": state.values.clone(),
        "threads": torch.get_num_threads(),  # the summation order of the model's matrix products
    }


def two_ranks(out: Path) -> None:
    """Every rank of the launch: each loss of LOSSES, POOL/K pairs a micro-batch on each of the K ranks."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name in LOSSES:
        trainer = make_trainer(out / f"{name}_ranks", name, POOL // world)
        torch.save(run(trainer, step_pairs()), out / f"{name}_rank{rank}.pt")


def assert_same_step(got: dict, want: dict, table: torch.Tensor | None = None) -> None:
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got["table"] if table is None else table, want["table"], rtol=1e-5, atol=1e-6)
