"""SigLIP on 2 real gloo ranks (pieces of the session's 2-rank suite):

- float64: each rank's loss and gradients (its features, log t, b) equal those open_clip's ``SigLipLoss``
  computes on that rank under each of its ``dist_impl``, the ranks' mean is the paper's formula over the
  whole batch (tests/siglip_reference.py), and our loss sends nothing but the all-gather of the features
  (open_clip's sends the texts' gradients back);
- a toy run: TOY_STEPS steps of the Trainer on toy shards lower the loss, and its checkpoint's export loads
  in open_clip with the learned logit_bias and scale.
"""

import json
import math

import open_clip
import pytest
import torch
import torch.distributed as dist
from open_clip.loss import SigLipLoss as OpenClipSigLipLoss
from siglip_reference import B, D, pairs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eva_fastclip.losses import Gatherer, SigLipLoss

TWO_RANK_PIECES = ("siglip", "siglip_toy")
TOY_STEPS, TOY_BATCH = 40, 32  # global: 2 ranks x 16
WORLD = 2
DIST_IMPLS = ("bidir", "shift", "reduce", "gather")
BIASES = (-10.0, -1.0)  # SigLIP's init (negatives ~e^-10) and one where the negatives weigh in


def on_this_rank(leaves, rank, contestant):
    """``contestant(x, y, t, b)`` on this rank's rows: its value and gradients (x, y, log t, b)."""
    images, texts, log_t, b = leaves
    own = slice(rank * (B // WORLD), (rank + 1) * (B // WORLD))
    x, y = images[own].clone().requires_grad_(True), texts[own].clone().requires_grad_(True)
    log_t, b = log_t.clone().requires_grad_(True), b.clone().requires_grad_(True)
    value, loss = contestant(x, y, log_t.exp(), b)
    return value, torch.autograd.grad(loss, (x, y, log_t, b))


def two_ranks(out):
    """Every rank: ours and open_clip's (each dist_impl) at each bias; saved to OUT/rank<K>.pt."""
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    results = {}
    for bias in BIASES:
        leaves, _, _ = pairs(seed=4, bias=bias)
        gatherer = Gatherer(rank, WORLD)

        def ours(x, y, t, b, gatherer=gatherer):
            output = SigLipLoss(gatherer)(x, y, t, torch.arange(B), logit_bias=b)
            return output.metrics["loss/contrastive"], output.loss

        results[bias, "ours"] = (*on_this_rank(leaves, rank, ours), dict(gatherer.traffic))
        for impl in DIST_IMPLS:
            theirs = OpenClipSigLipLoss(rank=rank, world_size=WORLD, dist_impl=impl)

            def open_clip(x, y, t, b, theirs=theirs):
                loss = theirs(x, y, t, b)
                return loss.item(), loss

            results[bias, impl] = on_this_rank(leaves, rank, open_clip)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def ranks(two_rank_suite):
    out = two_rank_suite("siglip")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("impl", DIST_IMPLS)
def test_each_rank_computes_what_open_clips_siglip_loss_computes_there(ranks, impl, bias):
    for rank, results in enumerate(ranks):
        value, grads, _ = results[bias, "ours"]
        their_value, their_grads = results[bias, impl]
        assert value == pytest.approx(their_value, rel=1e-12), f"rank {rank}"
        for name, got, want in zip(("images", "texts", "log t", "b"), grads, their_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("bias", BIASES)
def test_the_mean_over_ranks_is_the_papers_loss_and_only_features_are_sent(ranks, bias):
    """The engine's mean of the ranks' gradients (own features: K times their share) is the gradient of
    the paper's loss over all B pairs; each rank all-gathered 2·b·d float64 features and nothing else."""
    _, want_loss, want_grads = pairs(seed=4, bias=bias)
    b = B // WORLD
    for i in range(2):  # the features: each rank holds its rows'
        got = torch.cat([ranks[r][bias, "ours"][1][i] for r in range(WORLD)]) / WORLD
        torch.testing.assert_close(got, want_grads[i], rtol=1e-10, atol=1e-12)
    for i in (2, 3):  # log t and b: the mean
        got = sum(ranks[r][bias, "ours"][1][i] for r in range(WORLD)) / WORLD
        torch.testing.assert_close(got, want_grads[i], rtol=1e-10, atol=1e-12)
    assert sum(ranks[r][bias, "ours"][0] for r in range(WORLD)) / WORLD == pytest.approx(want_loss, rel=1e-12)
    for rank in ranks:
        assert rank[bias, "ours"][2] == {"features": 2 * b * D * 8}


# ---- a toy run --------------------------------------------------------------------------------------------


def toy_run(out):
    """Every rank: the Trainer of configs/toy.json with loss.name=siglip (SigLIP's t and b), 2 x 16 pairs a
    step on toy shards (rank 0 writes them), TOY_STEPS steps, a checkpoint at the end."""
    from eva_fastclip.config import load_config
    from eva_fastclip.data import write_toy_dataset
    from eva_fastclip.engine.build import build_trainer
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

    data = out / "toy"
    if dist.get_rank() == 0:
        write_toy_dataset(data, num_train=512, num_val=16, num_zeroshot=20, samples_per_shard=128, seed=0)
    dist.barrier()
    sets = [
        "model.name=test-vit-xs",
        "loss.name=siglip",
        "loss.temperature_init=0.1",
        f'data.train_shards=["{data / "train"}"]',
        "data.workers=0",
        f"train.batch_size={TOY_BATCH // 2}",
        f"train.steps={TOY_STEPS}",
        "train.log_every_steps=1",
        f"train.save_every_steps={TOY_STEPS}",
        f"train.output_dir={out / 'run'}",
        "train.precision=fp32",
        "optim.warmup_steps=2",
        "optim.lr=1e-2",
        "eval.zeroshot_dir=null",
        "eval.retrieval_shards=null",
    ]
    cfg = load_config("configs/toy.json", sets)
    build_trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config)).train()


@pytest.fixture(scope="module")
def toy(two_rank_suite):
    return two_rank_suite("siglip_toy") / "run"


def test_a_toy_run_lowers_the_loss_and_its_export_loads_in_open_clip_with_the_learned_bias(toy, tmp_path):
    from eva_fastclip.export import consolidated_state_dict, export_open_clip

    """The loss falls below what a constant logit of the best bias scores (-log p - (n-1)·log(1-p) for
    p = 1/n a row of n = TOY_BATCH: 4.45), which no bias or scale reaches without telling the pairs apart;
    it starts above that (SigLIP's init: ~10)."""
    events = EventAccumulator(str(toy / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    p = 1 / TOY_BATCH
    blind = -math.log(p) - (TOY_BATCH - 1) * math.log(1 - p)
    assert len(losses) == TOY_STEPS and min(losses[:4]) > blind, losses
    assert sum(losses[-8:]) / 8 < 0.95 * blind, losses

    checkpoint = toy / "checkpoints" / f"step_{TOY_STEPS:08d}"
    trained = consolidated_state_dict(checkpoint)
    assert trained["logit_bias"].shape == (1,) and trained["logit_bias"].item() != -10.0  # it learned
    folder = tmp_path / "model"
    export_open_clip(checkpoint, folder)
    config = json.loads((folder / "open_clip_config.json").read_text())["model_cfg"]
    assert config["init_logit_bias"] == pytest.approx(trained["logit_bias"].item())
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    assert model.logit_bias.shape == () and model.logit_bias.item() == trained["logit_bias"].item()
    assert model.logit_scale.item() == trained["logit_scale"].item()
    # open_clip's forward hands SigLIP's loss the bias, as our training did
    outputs = model(torch.zeros(1, 3, 32, 32), torch.ones(1, 16, dtype=torch.long))
    assert len(outputs) == 4 and outputs[3] is model.logit_bias
