"""``train.compile`` on 2 ranks (a piece of the session's 2-rank suite): the toy model with 50% masking, 3
steps of 2 x 8 pairs, compiled, takes the eager run's steps: every tensor of the engine's state (fp32
master, both moments, the module's weight) within 1e-4 of its norm on both ranks, and no graph compiles
again after step 2. The graphs are dynamo's and AOT autograd's with the aot_eager backend, which runs
them without generating code: what 2 ranks add (each rank's keys, the feature gather) does not depend on
the code generator, and inductor's, tested on one rank with resume and export in tests/test_compiled.py,
costs a minute of compiling per rank here."""

import os
from pathlib import Path

import torch

TWO_RANK_PIECES = ("compiled",)
STEPS, RTOL = 3, 1e-4


class RankBatches:
    """6 micro-batches of 8 pairs, each rank its own (seeded by the rank), dataset indices distinct."""

    num_batches, dataset_size, num_samples = 6, 96, 96

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        g = torch.Generator().manual_seed(10 + self.rank)
        for i in range(6):
            tokens = torch.randint(1, 49000, (8, 16), generator=g)
            yield torch.randn(8, 3, 32, 32, generator=g), tokens, torch.arange(8) + 8 * (2 * i + self.rank)


def run(out: Path, rank: int, *sets: str) -> dict:
    from engine_state import full_state
    from stand_ins import MASKED, toy_config, toy_trainer

    cfg = toy_config(out, *MASKED, f"train.steps={STEPS}", *sets, base=())
    trainer = toy_trainer(cfg, loader=RankBatches(rank))
    recompiles = []
    step = trainer.train_step

    def recorded(*args, **kwargs):
        metrics = step(*args, **kwargs)
        if metrics is not None and "compile/recompiles" in metrics:
            recompiles.append(metrics["compile/recompiles"])
        return metrics

    trainer.train_step = recorded
    trainer.train()
    state = full_state(trainer.engine)
    trainer.engine.destroy()
    return {"state": state, "recompiles": recompiles}


def compiled(out: Path) -> None:
    """Every rank of the 2-rank suite: the eager run, then the compiled one."""
    rank = int(os.environ["RANK"])
    compile_ = ("train.compile=true", "train.compile_backend=aot_eager")
    for name, sets in (("eager", ()), ("compiled", compile_)):
        torch.save(run(out / f"{name}_run", rank, *sets), out / f"{name}_rank{rank}.pt")


def test_two_compiled_ranks_take_the_eager_steps(two_rank_suite):
    out = two_rank_suite("compiled")
    for rank in (0, 1):
        eager, compiled = (torch.load(out / f"{name}_rank{rank}.pt") for name in ("eager", "compiled"))
        assert compiled["recompiles"] == [0.0] * STEPS and eager["recompiles"] == []
        for name, tensors in eager["state"].items():
            for what, a, b in zip(
                ("master", "exp_avg", "exp_avg_sq", "module"), compiled["state"][name], tensors
            ):
                error = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                assert error <= RTOL, f"rank {rank}: {name} {what} differs by {error:.2e} of its norm"
    # and the ranks trained one model
    states = [torch.load(out / f"compiled_rank{rank}.pt")["state"] for rank in (0, 1)]
    assert all(torch.equal(states[0][n][0], states[1][n][0]) for n in states[0])
