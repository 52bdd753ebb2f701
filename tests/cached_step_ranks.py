"""Optimizer steps of a whole dataset of DATASET pairs, one step an epoch, through the real Trainer: the
layouts that tests/test_cached_step.py and tests/launched/test_cached_step_two_ranks.py compare. On 2 ranks
(:func:`two_ranks`, a piece of tests/launched/two_rank_suite.py) every rank saves what it holds after the
steps of each configuration of LAUNCHED to ``OUT/<name>_rank<K>.pt``.

Every step takes all DATASET pairs in a new order, in its own epoch: step 2 reads the u (and tau_i) that
step 1 committed (gamma < 1 from epoch 1 on), step 3 those of step 2. A layout splits the step's pairs
over its ranks and micro-batches in order; with ``train.contrastive_batch=global`` any split is the step of
one rank taking all DATASET pairs in one micro-batch. The loader hands no keys: the Trainer derives each
sample's key (its crop and token mask) from the seed, the epoch and its index, as TrainLoader would.
"""

import json
import os
from pathlib import Path

import torch
from engine_state import full_state

__all__ = ["full_state"]  # (tests read the engine's state through this module)

from eva_fastclip.config import load_config
from eva_fastclip.engine.build import build_trainer
from eva_fastclip.engine.trainer import Trainer

DATASET, STEPS = 32, 3
#: the losses (and options) the tests run: config overrides by name
LOSSES = {
    "fastclip_v3": ["loss.name=fastclip_v3", "loss.tau_gradient=exact"],  # global tau, exact gradient
    "fastclip_v3_code": ["loss.name=fastclip_v3", "loss.tau_gradient=fastclip_code"],  # FastCLIP's
    "fastclip_v2": ["loss.name=fastclip_v2"],  # individual tau_i, Adam-like
    "isogclr": ["loss.name=isogclr"],  # individual tau_i
    "sogclr": ["loss.name=sogclr"],  # fixed tau
    "openclip": ["loss.name=openclip"],  # InfoNCE, learnable tau
    "siglip": ["loss.name=siglip", "loss.temperature_init=0.1"],  # sigmoid, learnable t and b
}
#: what the 2-rank launch runs: (loss, ZeRO stage); each 2 ranks x 4 micro-batches of 4, global (SigLIP's
#: 2-rank layouts are SIGLIP_LAYOUTS')
LAUNCHED = [(loss, 1) for loss in LOSSES if loss != "siglip"]
LAUNCHED += [("fastclip_v3", 0), ("fastclip_v3", 2), ("openclip", 2)]
#: SigLIP on SIGLIP_DATASET pairs (3 fp32 steps, 50% masking) against 1 rank x one micro-batch of them:
#: 2-rank layout -> (micro-batch, micro-batches, train.contrastive_batch)
SIGLIP_DATASET = 128
SIGLIP_LAYOUTS = {
    "2x64": (64, 1, "global"),
    "2x4x16_global": (16, 4, "global"),
    "2x4x16_micro": (16, 4, "micro"),
}


def step_pairs(dataset: int = DATASET) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """STEPS steps: every pair's image and tokens (by dataset index), and the step's order of the pairs."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(dataset, 3, 32, 32, generator=g)
    tokens = torch.randint(1, 49000, (dataset, 16), generator=g)
    return [(images, tokens, torch.randperm(dataset, generator=g)) for _ in range(STEPS)]


class StandIn:
    """A loader the Trainer accepts; the micro-batches are fed to train_step by hand."""

    def __init__(self, micro_batches: int, dataset: int = DATASET) -> None:
        self.num_batches = micro_batches  # one optimizer step an epoch
        self.dataset_size = self.num_samples = dataset

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        return iter(())


def make_trainer(
    out: Path,
    loss: str,
    micro: int,
    accum: int,
    contrastive: str = "global",
    stage: int = 1,
    patch_dropout: float = 0.5,
    model: str = "test-vit-xs",
    dataset: int = DATASET,
) -> Trainer:
    ds = json.loads(Path("ds_configs/zero1_fp32_lamb.json").read_text())
    ds["zero_optimization"]["stage"] = stage
    cfg = load_config(
        "configs/toy.json",
        [
            f"model.name={model}",
            f"model.patch_dropout={patch_dropout}",
            *LOSSES[loss],
            f"train.batch_size={micro}",
            f"train.grad_accum_steps={accum}",
            f"train.contrastive_batch={contrastive}",
            f"train.steps={STEPS}",
            f"train.output_dir={out}",
            "optim.warmup_steps=0",
            "eval.zeroshot_dir=null",
            "eval.retrieval_shards=null",
        ],
    )
    return build_trainer(cfg, ds, loader=StandIn(accum, dataset))


def run(trainer: Trainer, steps=None) -> dict:
    """Feed every step's pairs (this rank's share, in micro-batches); return what the rank holds: the
    engine's whole state (fp32 masters, both moments, the module's weights; the temperature's too), every
    buffer, and its rows of the per-sample table."""
    rank, world = trainer.rank, trainer.world_size
    micro, accum = trainer.layout.micro_batch, trainer.layout.grad_accum_steps
    losses = []
    for epoch, (images, tokens, order) in enumerate(steps or step_pairs()):
        trainer.epoch = epoch  # the samples' keys (their masks) and gamma follow the epoch
        trainer.loss.set_epoch(epoch)
        mine = order.reshape(world, -1)[rank]
        for t in range(accum):
            indices = mine[t * micro : (t + 1) * micro]
            metrics = trainer.train_step(images[indices], tokens[indices], indices)
            assert (metrics is None) == (t < accum - 1)  # one optimizer step per step's pairs
        assert metrics["step_applied"] == 1.0
        losses.append(metrics["loss"])
        trainer.step += 1
    state = getattr(trainer.loss, "state", None)
    return {
        "engine": full_state(trainer.engine),
        "buffers": {k: v.detach().clone() for k, v in trainer.engine.module.named_buffers()},
        "lo": None if state is None else state.lo,
        "table": None if state is None else state.values.clone(),
        "losses": losses,
    }


#: each loss's reference, made once in a process: the unit tests and the launched ones compare with it
_ONE_MICRO_BATCH: dict[str, dict] = {}


def one_micro_batch(loss: str, folder: Path) -> dict:
    """The reference of ``loss``: 1 rank x one micro-batch of all DATASET pairs (ZeRO-1, 50% masking), run
    in this process the first time it is asked for (its Trainer's files under ``folder``)."""
    if loss not in _ONE_MICRO_BATCH:
        _ONE_MICRO_BATCH[loss] = run(make_trainer(folder / loss, loss, DATASET, 1))
    return _ONE_MICRO_BATCH[loss]


def siglip_one_micro_batch(folder: Path) -> dict:
    """SigLIP's reference for SIGLIP_LAYOUTS: 1 rank x one micro-batch of SIGLIP_DATASET pairs."""
    key = f"siglip_{SIGLIP_DATASET}"
    if key not in _ONE_MICRO_BATCH:
        trainer = make_trainer(folder / key, "siglip", SIGLIP_DATASET, 1, dataset=SIGLIP_DATASET)
        _ONE_MICRO_BATCH[key] = run(trainer, step_pairs(SIGLIP_DATASET))
    return _ONE_MICRO_BATCH[key]


def two_ranks(out: Path) -> None:
    """Every rank of the launch: each configuration of LAUNCHED, 4 micro-batches of DATASET/(4K) pairs on
    each of the K ranks; then SigLIP's SIGLIP_LAYOUTS."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_rank = DATASET // world
    for loss, stage in LAUNCHED:
        name = f"{loss}_zero{stage}"
        trainer = make_trainer(out / f"{name}_run", loss, micro=per_rank // 4, accum=4, stage=stage)
        torch.save(run(trainer), out / f"{name}_rank{rank}.pt")
    for name, (micro, accum, contrastive) in SIGLIP_LAYOUTS.items():
        trainer = make_trainer(
            out / f"siglip_{name}_run", "siglip", micro, accum, contrastive, dataset=SIGLIP_DATASET
        )
        torch.save(run(trainer, step_pairs(SIGLIP_DATASET)), out / f"siglip_{name}_rank{rank}.pt")


#: how close the states must be, of each tensor's norm (tests/test_cached_step.py's docstring)
RTOL = 1e-4


def relative_difference(a: dict, b: dict) -> float:
    """The largest difference of the module's weights, relative to each one's norm."""
    return max(
        ((a["engine"][name][3] - b["engine"][name][3]).norm() / b["engine"][name][3].norm()).item()
        for name in b["engine"]
    )


def assert_same_state(got: dict, want: dict, label: str, tables: tuple | None = None) -> None:
    """Every tensor of the engine (master, moments, module weight), every buffer and the per-sample
    table within RTOL of its norm."""
    pairs = [(f"{name}[{i}]", g, w) for name in want["engine"] for i, (g, w) in
             enumerate(zip(got["engine"][name], want["engine"][name]))]  # fmt: skip
    pairs += [(f"buffer {name}", got["buffers"][name], w) for name, w in want["buffers"].items()]
    if want["table"] is not None:
        pairs.append(("per-sample table", tables[0] if tables else got["table"], want["table"]))
    for what, g, w in pairs:
        g, w = g.double(), w.double()
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g)), f"{label}: {what} finite elsewhere"
        error = (g[finite] - w[finite]).norm()
        assert error <= RTOL * w[finite].norm() + 1e-12, (
            f"{label}: {what} off by {error / w[finite].norm():.2e}"
        )
