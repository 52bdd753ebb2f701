"""LAMB's trust ratio is per model tensor whatever ZeRO does: ZeRO-0, 1 and 2 on 1 and 2 ranks, fp32 and bf16
masters, take the same 3 steps as a float64 per-tensor LAMB (lamb_reference.kernel_step, FusedLamb's kernel),
and every optimizer call of theirs, replayed in float64, gives the multi-tensor step (both ways of walking
memory) within 1e-12 of today's Lamb (lamb_reference.TodaysLamb).

Every configuration sees the same global gradient: the loss is linear in the weights, sum(w * G) with a
fixed G per step that bf16 holds exactly, so the gradient is G on every rank and in every precision, and
only the optimizer can make the runs differ. The 2-rank configurations are a piece of the session's 2-rank
suite (tests/launched/test_lamb_zero_two_ranks.py).
"""

import pytest
from lamb_zero_runs import CONFIGS, ONE_RANK, assert_per_tensor, assert_replays_agree, reference, run


@pytest.fixture(scope="module")
def expected():
    return reference()


@pytest.mark.parametrize("name", ONE_RANK)
def test_one_rank_steps_are_per_tensor(name, expected):
    from eva_fastclip.reliability.process import init_process_group

    init_process_group()
    result = run(name, 1)
    assert_per_tensor(result, expected, f"{name} on 1 rank", bf16=CONFIGS[name][1] == "bf16")
    assert_replays_agree(result, name)
