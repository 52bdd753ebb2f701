"""``train.contrastive_batch: global``: an optimizer step of K ranks x a micro-batches of b pairs is the step
of one rank taking all G = a·b·K pairs in one micro-batch (engine/contrastive_step.py, docs/losses.md).

Three levels:
- the losses alone, in float64: a cached step over a micro-batches against one evaluation over all G pairs,
  every loss, gradients of the weights and of the temperature and the per-sample table, over two epochs;
- the real Trainer and DeepSpeed engine in fp32, 1 rank x 4 micro-batches of 8 against 1 rank x one
  micro-batch of 32, 3 steps (each reads the state the one before committed), with 50% token masking, ZeRO
  0/1/2, on the whole state: fp32 masters, both optimizer moments, the module's weights and buffers (the
  temperature among the weights) and every field of the per-sample table;
- 2 ranks x 4 micro-batches of 4 against the same one-rank step, and the command line on real shards:
  tests/launched/test_cached_step_two_ranks.py.
And the converse: ``micro`` takes another step (its loss evaluations see 8 pairs, not 32).

Tolerance. fp32 runs agree to 1e-4 of each tensor's norm. The layouts add the same terms in other orders
(the matmuls of 8 against 32 rows, the gradient summed over 4 micro-batches and 2 ranks), each sum off by
a few float32 ulps (1.2e-7 relative), compounded over 3 LAMB steps: measured here, every tensor within 2e-6
of its norm but the attention's in_proj_bias, within 3e-5 (its key part gets no gradient but float noise,
softmax ignoring a per-query constant, and LAMB's m/sqrt(v) scales that noise to whole steps). Another
contrastive batch (the converse test) moves weights and moments by tenths of their norm and more (0.4 to 2
on those tensors), the per-sample table by 0.3: thousands of times the tolerance.
"""

import cached_step_ranks as layouts
import pytest
import torch
import torch.nn.functional as F
from cached_step_ranks import assert_same_state

from eva_fastclip.losses import build_loss

# ---- the losses alone, float64 -----------------------------------------------------------------------

LOSS_NAMES = ["openclip", "fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3", "sogclr", "isogclr"]


def _loss_run(name: str, cached: bool, tau_gradient: str | None = None, micro_batches: int = 4):
    """Two steps (epochs 0 and 1) of a linear two-tower model over 16 pairs; gradients and table."""
    g = torch.Generator().manual_seed(0)
    n, d = 16, 8
    x1, x2 = (
        torch.randn(n, 6, generator=g, dtype=torch.float64),
        torch.randn(n, 6, generator=g, dtype=torch.float64),
    )
    w1 = torch.randn(6, d, generator=g, dtype=torch.float64).requires_grad_()
    w2 = torch.randn(6, d, generator=g, dtype=torch.float64).requires_grad_()
    scale = torch.tensor([1 / 0.05], dtype=torch.float64, requires_grad=True)
    indices = torch.randperm(40, generator=g)[:n]
    options = {} if name == "openclip" else {"dataset_size": 40, "gamma_decay_epochs": 2}
    if tau_gradient is not None:
        options["tau_gradient"] = tau_gradient
    loss = build_loss(name, **options).double()

    def features(rows):
        return F.normalize(x1[rows] @ w1, dim=-1), F.normalize(x2[rows] @ w2, dim=-1)

    b = n // micro_batches
    for epoch in range(2):
        loss.set_epoch(epoch)
        order = torch.randperm(n, generator=g)
        if not cached:
            loss(*features(order), scale, indices[order]).loss.backward()
        else:
            with torch.no_grad():
                e1, e2 = features(order)
            loss.begin_cached_step(e1, e2, scale.detach(), indices[order], micro_batch=b)
            for m in range(micro_batches):  # the engine divides each micro-batch's loss by their number
                rows = order[m * b : (m + 1) * b]
                (loss.cached_forward(*features(rows), scale, m).loss / micro_batches).backward()
            loss.end_cached_step()
        loss.on_step_applied()
    table = loss.state.values.clone() if hasattr(loss, "state") else None
    return w1.grad, w2.grad, scale.grad, table


@pytest.mark.parametrize(
    "name, tau_gradient",
    [(name, None) for name in LOSS_NAMES] + [("fastclip_v3", "exact"), ("fastclip_v3", "fastclip_code")],
)
def test_a_cached_step_is_one_evaluation_over_all_pairs(name, tau_gradient):
    """4 micro-batches of 4 pairs, each against all 16 with its own live, give the gradients and the
    per-sample state of one evaluation over the 16 (the float64 reference of test_compositional_exact.py
    and test_openclip_loss.py), to float64 precision."""
    whole = _loss_run(name, cached=False, tau_gradient=tau_gradient)
    cached = _loss_run(name, cached=True, tau_gradient=tau_gradient)
    for label, want, got in zip(("w1", "w2", "tau", "table"), whole, cached):
        if want is None:
            assert got is None, label
            continue
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=label)
    assert whole[0].abs().max() > 1e-3  # a gradient to compare


def test_one_micro_batch_of_a_cached_step_is_the_plain_loss():
    """``forward`` is the cached step of one micro-batch (the compositional losses), and a cached step
    of the OpenCLIP loss over one micro-batch is its ``forward``."""
    for name in ("openclip", "fastclip_v3"):
        plain = _loss_run(name, cached=False)
        one = _loss_run(name, cached=True, micro_batches=1)
        for want, got in zip(plain, one):
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ---- the Trainer and the engine, one process ---------------------------------------------------------


@pytest.fixture(scope="module")
def one_micro_batch(tmp_path_factory):
    """The reference of every loss: 1 rank x one micro-batch of all 32 pairs (ZeRO-1, 50% masking)."""
    tmp = tmp_path_factory.mktemp("one_micro_batch")
    return {loss: layouts.one_micro_batch(loss, tmp) for loss in layouts.LOSSES}


@pytest.mark.parametrize("loss", list(layouts.LOSSES))
def test_four_micro_batches_take_the_step_of_one(loss, one_micro_batch, tmp_path):
    got = layouts.run(layouts.make_trainer(tmp_path, loss, 8, 4))
    assert_same_state(got, one_micro_batch[loss], f"{loss}: 1 rank x 4 x 8, global")
    assert got["losses"] == pytest.approx(one_micro_batch[loss]["losses"], rel=1e-4)


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("loss", ["fastclip_v3", "openclip"])
def test_zero_stages_take_the_same_cached_step(loss, stage, one_micro_batch, tmp_path):
    got = layouts.run(layouts.make_trainer(tmp_path, loss, 8, 4, stage=stage))
    assert_same_state(got, one_micro_batch[loss], f"{loss}: ZeRO-{stage}, 1 rank x 4 x 8, global")


def test_an_eva_tower_takes_the_step_of_one_micro_batch(tmp_path):
    """A timm EVA trunk (its masks drop RoPE rows too: PatchDropoutWithIndices), 50% masking."""
    runs = [
        layouts.run(
            layouts.make_trainer(
                tmp_path / str(micro), "fastclip_v3", micro, 32 // micro, model="test-eva02-xs"
            )
        )
        for micro in (32, 8)
    ]
    assert_same_state(runs[1], runs[0], "test-eva02-xs: 1 rank x 4 x 8, global")


def test_a_non_finite_step_leaves_no_trace(tmp_path):
    """A NaN image in the third micro-batch of a cached step: ZeRO-1 skips the step, and the per-sample
    state staged once for all 32 pairs is dropped with it; the weights and the table stay as step 1 left
    them, and the next step trains on."""

    def feed(epoch, images, tokens, order):  # one step of 4 micro-batches of 8
        trainer.epoch = epoch
        trainer.loss.set_epoch(epoch)
        for rows in order.reshape(4, 8):
            metrics = trainer.train_step(images[rows], tokens[rows], rows)
        return metrics

    trainer = layouts.make_trainer(tmp_path, "fastclip_v3", 8, 4)
    first, (images, tokens, order), third = layouts.step_pairs()
    assert feed(0, *first)["step_applied"] == 1.0
    table, weights = trainer.loss.state.values.clone(), layouts.full_state(trainer.engine)
    images = images.clone()
    images[order[16]] = float("nan")
    metrics = feed(1, images, tokens, order)
    assert metrics["step_applied"] == 0.0 and metrics["loss_finite"] == 0.0
    assert torch.equal(trainer.loss.state.values, table)
    for name, tensors in layouts.full_state(trainer.engine).items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, weights[name])), name
    assert feed(2, *third)["step_applied"] == 1.0
    assert not torch.equal(trainer.loss.state.values, table)


def test_pass_two_replays_the_random_draws_of_pass_one():
    """A tower with dropout (a Hugging Face text tower's default): pass 2 of every micro-batch computes
    exactly the features pass 1 cached, its dropout draws replayed (the loss is handed both)."""
    from eva_fastclip.engine.contrastive_step import CachedStep, MicroBatch
    from eva_fastclip.losses import build_loss

    class Towers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.image, self.text = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
            self.drop = torch.nn.Dropout(0.5)
            self.logit_scale = torch.nn.Parameter(torch.tensor([1 / 0.07]))

        def forward(self, images, tokens):
            e1 = torch.nn.functional.normalize(self.drop(self.image(images)), dim=-1)
            return e1, torch.nn.functional.normalize(self.drop(self.text(tokens)), dim=-1), self.logit_scale

    class Engine:  # what CachedStep asks of DeepSpeed's engine
        def __init__(self, module):
            self.module = module

        def __call__(self, *inputs):
            return self.module(*inputs)

        def backward(self, loss):
            (loss / 4).backward()

        def step(self):
            pass

    loss = build_loss("fastclip_v1", dataset_size=16, gamma_decay_epochs=1)
    seen = []
    real = loss.cached_forward

    def cached_forward(e1, e2, scale, micro):  # the live features against those pass 1 cached
        offset = micro * 4
        seen.append(torch.equal(e1, loss._cached.e1_all[offset : offset + 4]))
        seen.append(torch.equal(e2, loss._cached.e2_all[offset : offset + 4]))
        return real(e1, e2, scale, micro)

    loss.cached_forward = cached_forward
    step = CachedStep(Engine(Towers().train()), loss, lambda images: images, micro_batches=4)
    g = torch.Generator().manual_seed(0)
    for t in range(4):
        rows = torch.arange(t * 4, t * 4 + 4)
        outs, done = step.add(
            MicroBatch(torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), rows, rows)
        )
    assert done and len(outs) == 4 and seen == [True] * 8


def test_one_micro_batch_a_step_takes_the_plain_step(tmp_path, caplog):
    """Without accumulation both modes see the whole step: global adds no pass and holds nothing."""
    from eva_fastclip.engine.contrastive_step import MicroBatchStep

    with caplog.at_level("INFO", logger="eva_fastclip"):
        trainer = layouts.make_trainer(tmp_path, "fastclip_v3", 32, 1)
    assert isinstance(trainer.contrastive_step, MicroBatchStep) and "holds the features" not in caplog.text


@pytest.mark.parametrize("loss", ["fastclip_v3", "openclip", "siglip"])
def test_micro_takes_another_step(loss, one_micro_batch, tmp_path):
    """The converse: with ``micro`` the same 4 micro-batches of 8 see 8 pairs each, and the step is not
    the one-micro-batch step (OpenCLIP: another objective; the compositional losses: other g and u)."""
    micro = layouts.run(layouts.make_trainer(tmp_path, loss, 8, 4, contrastive="micro"))
    # SigLIP at its init (b = -10) weighs each negative by about e^-10 beside its positives, which every
    # layout scores alike: its micro step is nearer (0.6% here) yet 50 times the tolerance away
    assert layouts.relative_difference(micro, one_micro_batch[loss]) > (
        10 * layouts.RTOL if loss == "siglip" else 0.1
    )


def test_batch_norm_statistics_move_once_per_micro_batch(tmp_path):
    """RN towers: pass 1 runs BatchNorm in training mode and puts its running statistics back, so a
    cached step leaves the statistics that micro accumulation leaves: each micro-batch's forward once."""
    runs = {}
    for mode in ("micro", "global"):
        trainer = layouts.make_trainer(
            tmp_path / mode, "openclip", 8, 4, contrastive=mode, model="test-rn-xs"
        )
        runs[mode] = layouts.run(trainer, layouts.step_pairs()[:1])["buffers"]
    tracked = {k: v for k, v in runs["global"].items() if k.endswith("num_batches_tracked")}
    assert tracked and all(int(v) == 4 for v in tracked.values())  # 4 forwards in the step, not 8
    for name, value in runs["micro"].items():
        torch.testing.assert_close(runs["global"][name], value, msg=name)


def test_the_start_up_log_states_the_contrastive_batch_and_the_memory_held(tmp_path, caplog):
    with caplog.at_level("INFO", logger="eva_fastclip"):
        layouts.make_trainer(tmp_path, "fastclip_v3", 8, 4)
    assert "each loss evaluation sees 32 pairs (the contrastive batch: the whole step's pairs" in caplog.text
    # 2 x 32 pairs x 32 dims x 4 bytes of features; 32 float images of 3 x 32 x 32 from the stand-in loader
    assert "holds the features of the step's 32 pairs (0.0 MiB) and its 32 images of the step (0.4 MiB)" in (
        caplog.text
    )
