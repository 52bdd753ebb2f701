"""LAMB's trust ratio per model tensor on 2 ranks (tests/test_lamb_zero.py has the model, the float64
reference and the one-rank runs): ZeRO-1 and 2, fp32 and bf16 masters, a tensor split between the ranks,
the same 3 steps as the per-tensor reference, also across a save and load, and every optimizer call,
replayed in float64, the same as today's Lamb within 1e-12; a piece of the session's 2-rank suite."""

import pytest
import torch
import torch.distributed as dist
from lamb_zero_runs import CONFIGS, assert_per_tensor, assert_replays_agree, reference, relative_error, run

TWO_RANK_PIECES = ("lamb_zero",)
TWO_RANKS = ("zero1-fp32", "zero2-fp32", "zero1-bf16", "zero2-bf16", "zero1-bf16-fp32-grads")


def two_ranks(out):
    """Every rank of the 2-rank suite (tests/launched/two_rank_suite.py): each configuration's 3 steps;
    rank 0 saves them to OUT/results.pt."""
    results = {name: run(name, 2) for name in TWO_RANKS}
    results["zero1-fp32-resumed"] = run("zero1-fp32", 2, checkpoint_dir=str(out / "ckpt"))
    results["zero1-fp32-per-partition"] = run("zero1-fp32", 2, trust_ratio="per_zero_partition")
    results["zero0-fp32"] = run("zero0-fp32", 2)  # whole tensors on each rank, all-reduced gradients
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")
    replays = {name: result["replays"] for name, result in results.items()}
    torch.save(replays, out / f"replays_rank{dist.get_rank()}.pt")  # each rank's float64 replays


@pytest.fixture(scope="module")
def two_rank_results(two_rank_suite):
    return torch.load(two_rank_suite("lamb_zero") / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def expected():
    return reference()


def test_two_ranks_take_the_same_steps_as_one(two_rank_results, expected):
    for name in TWO_RANKS:
        result = two_rank_results[name]
        assert result["split"], f"{name}: no tensor is split between the ranks; the test would prove nothing"
        assert_per_tensor(result, expected, f"{name} on 2 ranks", bf16=CONFIGS[name][1] == "bf16")
    resumed = two_rank_results["zero1-fp32-resumed"]
    assert_per_tensor(resumed, expected, "zero1-fp32 on 2 ranks, saved and loaded", bf16=False)
    assert_per_tensor(two_rank_results["zero0-fp32"], expected, "zero0-fp32 on 2 ranks", bf16=False)


def test_per_zero_partition_keeps_deepspeeds_rule(two_rank_results, expected):
    """The option named for DeepSpeed's behaviour does differ: ratios of flat partitions, not tensors."""
    last = two_rank_results["zero1-fp32-per-partition"]["states"][-1]
    errors = {name: relative_error(last[name][0], w) for name, (w, _, _) in expected[-1].items()}
    assert max(errors.values()) > 1e-3, errors


def test_the_multi_tensor_step_is_todays_in_float64_on_both_ranks(two_rank_suite):
    """Every optimizer call of every configuration on either rank, replayed in float64 (the fragments of
    tensors the ranks split, their sums all-reduced): the multi-tensor step within 1e-12 of today's."""
    for rank in (0, 1):
        replays = torch.load(two_rank_suite("lamb_zero") / f"replays_rank{rank}.pt")
        for name, errors in replays.items():
            assert_replays_agree({"replays": errors}, f"{name}, rank {rank}")
