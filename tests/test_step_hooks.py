"""Through the real DeepSpeed engine (one rank, in this process):
(d) a step with non-finite gradients is skipped and leaves model, temperature and per-sample state as
they were; (e) saving and resuming reproduces the next step exactly. Plus re-sharding of the per-sample
state when the number of ranks changes."""

import pytest
import torch
from engine_state import full_state
from stand_ins import StandInBatches, toy_config, toy_trainer

from eva_fastclip.engine.setup import read_full_parameter
from eva_fastclip.losses import Gatherer, PerSampleTable

BATCH = 8


def make_trainer(tmp_path, loss, resume=None):
    cfg = toy_config(
        tmp_path, f"loss.name={loss}", f"train.batch_size={BATCH}", "train.epochs=3", "optim.warmup_steps=1"
    )
    return toy_trainer(cfg, loader=StandInBatches(6, BATCH), resume=resume)


def snapshot(trainer):
    """The per-sample table (a mini-batch loss has none), the temperature, every weight and buffer (SigLIP's
    logit_bias too) and the optimizer's masters and moments."""
    module = trainer.engine.module
    state = getattr(trainer.loss, "state", None)
    return {
        "table": None if state is None else state.values.clone(),
        "theta": read_full_parameter(module.logit_scale).clone(),
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer": full_state(trainer.engine),
        "optimizer_steps": trainer.engine.global_steps,
    }


@pytest.mark.parametrize("loss", ["fastclip_v3", "fastclip_v2"])
def test_non_finite_step_changes_nothing(tmp_path, loss):
    trainer = make_trainer(tmp_path, loss)
    batches = trainer.loader.batches
    assert trainer.train_step(*batches[0])["step_applied"] == 1.0
    before = snapshot(trainer)

    images, tokens, indices = batches[1]
    poisoned = images.clone()
    poisoned[0] = float("nan")  # -> non-finite features, loss and gradients
    metrics = trainer.train_step(poisoned, tokens, indices)
    assert metrics["step_applied"] == 0.0 and not trainer.engine.was_step_applied()
    after = snapshot(trainer)
    assert torch.equal(after["table"], before["table"])
    assert torch.equal(after["theta"], before["theta"])
    for key, value in before["weights"].items():
        assert torch.equal(after["weights"][key], value), key

    # the same batch, clean, is applied and moves the state of exactly its own samples
    assert trainer.train_step(images, tokens, indices)["step_applied"] == 1.0
    changed = (trainer.loss.state.values != before["table"]).any(dim=1).nonzero().flatten()
    assert set(changed.tolist()) <= set(indices.tolist()) and len(changed) > 0


@pytest.mark.parametrize("loss", ["fastclip_v3", "fastclip_v2", "siglip"])
def test_resume_reproduces_the_next_step_exactly(tmp_path, loss):
    first = make_trainer(tmp_path, loss)
    batches = first.loader.batches
    for batch in batches[:3]:
        first.train_step(*batch)
        first.step += 1
    first.loss.set_epoch(1)  # gamma < 1 and the temperature's own schedule from here on
    first.train_step(*batches[3])
    first.step += 1
    first.save()
    expected = first.train_step(*batches[4])
    want = snapshot(first)

    resumed = make_trainer(tmp_path, loss, resume="latest")
    assert resumed.step == 4
    resumed.loss.set_epoch(1)
    got = resumed.train_step(*batches[4])
    have = snapshot(resumed)
    assert got["loss"] == expected["loss"]
    assert (have["table"] is None) == (loss == "siglip")
    assert have["table"] is None or torch.equal(have["table"], want["table"])
    assert torch.equal(have["theta"], want["theta"])
    for key, value in want["weights"].items():
        assert torch.equal(have["weights"][key], value), key
    for name, tensors in want["optimizer"].items():  # master, both moments, the module's copy
        assert all(torch.equal(h, w) for h, w in zip(have["optimizer"][name], tensors)), name
    if loss == "siglip":  # the learned bias is state like any weight: moved by the steps, resumed exactly
        assert have["weights"]["logit_bias"].item() != -10.0 and "logit_bias" in have["optimizer"]


def test_per_sample_state_survives_a_change_of_rank_count(tmp_path):
    fields = {"log_u1": float("-inf"), "tau1": 0.03}
    size = 11
    written = torch.arange(size * 2, dtype=torch.float32).reshape(size, 2)
    for rank in range(2):  # saved by a 2-rank job
        table = PerSampleTable(size, fields, Gatherer(rank, 2))
        table.values = written[table.lo : table.hi].clone()
        table.save(tmp_path)
    for world in (1, 3, 4):  # read back by 1, 3 and 4 ranks
        parts = []
        for rank in range(world):
            table = PerSampleTable(size, fields, Gatherer(rank, world))
            table.load(tmp_path)
            parts.append(table.values)
        assert torch.equal(torch.cat(parts), written)
    with pytest.raises(ValueError, match="another loss or dataset"):
        PerSampleTable(size, {"log_u1": 0.0, "log_u2": 0.0}, Gatherer()).load(tmp_path)
    (tmp_path / "per_sample_000000000000-000000000006.pt").unlink()
    with pytest.raises(FileNotFoundError, match="dataset index 0"):
        PerSampleTable(size, fields, Gatherer()).load(tmp_path)
