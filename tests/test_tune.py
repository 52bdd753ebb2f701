"""`eva-fastclip tune`: the layouts, the memory model against measured peaks, out-of-memory probes
(docs/launching.md, Tuning). On 2 ranks (the out-of-memory probe agreed, the search as a user runs it):
tests/launched/test_tune_two_ranks.py."""

import json

import pytest
import torch
from tune_cases import MIB, REPO, toy_overrides

from eva_fastclip.config import load_config, read_raw_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config
from eva_fastclip.plan.layout import batch_layout
from eva_fastclip.tensor_memory import StorageTracker
from eva_fastclip.tune import TuneOptions, Tuner
from eva_fastclip.tune.layouts import Candidate, Trial, assign_verdicts, candidates
from eva_fastclip.tune.probe import model_probe


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune_toy")
    write_toy_dataset(out, num_train=1024, num_val=16, num_zeroshot=16, samples_per_shard=256, seed=0)
    return out


# ---- layouts and the objective ------------------------------------------------------------------------


def test_candidates_are_every_layout_of_the_global_batch():
    found = candidates(128, 2)
    micro = sorted({c.micro_batch for c in found})
    assert micro == [1, 2, 4, 8, 16, 32, 64]  # the divisors of a rank's share, 64
    for c in found:
        assert c.global_batch == 128
        assert c.micro_batch * c.grad_accum_steps == 64
        assert c.contrastive_batch == (128 if c.contrastive == "global" else 2 * c.micro_batch)
    # a global contrastive batch only where there is accumulation; 3 stages, 2 checkpointing settings
    assert not [c for c in found if c.contrastive == "global" and c.grad_accum_steps == 1]
    assert len(found) == 6 * (1 + 2 * 6)


def _trial(micro, accum, contrastive="micro", peak=None, speed=None, oom=False, est=None, stage=0):
    candidate = Candidate(micro, accum, contrastive, False, stage, 2)
    est = est if est is not None else (peak if peak is not None else 0)
    return Trial(candidate, est, {"peak": est}, peak=peak, samples_per_s=speed, oom=oom)


def test_verdicts_follow_the_objective_in_its_order():
    budget = 100
    trials = {
        "whole": _trial(64, 1, peak=120, speed=900.0),  # the reference's batch, over the budget
        "oom": _trial(64, 1, oom=True, stage=1),
        "global": _trial(32, 2, "global", peak=90, speed=500.0),  # c = 128, fits
        "micro fast": _trial(32, 2, peak=80, speed=700.0),  # faster but c = 64 < 128
        "global slow": _trial(16, 4, "global", peak=60, speed=300.0),  # c = 128, slower
        "unprobed": _trial(8, 8, "global", est=50),  # fits by estimate only
        "estimated over": _trial(64, 1, est=150, stage=2),
    }
    chosen = assign_verdicts(list(trials.values()), budget, target_contrastive=128)
    assert chosen is trials["global"]  # fits, reaches c = 128, the fastest that does
    verdicts = {name: t.verdict for name, t in trials.items()}
    assert verdicts == {
        "whole": "over_limit",
        "oom": "oom",
        "global": "chosen",
        "micro fast": "fits",  # a smaller contrastive batch: not compared on speed
        "global slow": "slower",
        "unprobed": "fits",
        "estimated over": "over_limit",
    }
    assert trials["whole"].why.startswith("measured") and trials["estimated over"].why.startswith("estimated")
    # asked for a contrastive batch of 64: the fastest that reaches it wins
    assert assign_verdicts(list(trials.values()), budget, target_contrastive=64) is trials["micro fast"]
    # nothing fits
    assert assign_verdicts([_trial(64, 1, peak=120)], budget, 128) is None


def test_storage_tracker_limit_raises_where_a_device_would():
    kept = []
    with StorageTracker(limit=3 * MIB) as tracker:
        kept.append(torch.zeros(MIB // 4))  # 1 MiB of float32
        kept.append(torch.zeros(MIB // 4))
        with pytest.raises(torch.OutOfMemoryError, match=r"would reach 3\.0 MiB.*over the limit of 3\.0 MiB"):
            kept.append(torch.zeros(MIB // 4 + 1))  # 1 MiB and 4 bytes: over
        del kept[:]
        torch.zeros(2 * MIB // 4)  # freed first: fits again
    assert tracker.peak >= 2 * MIB


# ---- the memory model against measured peaks (one rank, in this process) ----------------------------


def test_estimates_are_within_15_percent_of_the_measured_peaks(toy, tmp_path):
    overrides = toy_overrides(toy, tmp_path / "run")
    cfg = load_config(REPO / "configs/toy.json", overrides)
    raw = read_raw_config(REPO / "configs/toy.json", overrides)
    ds = load_deepspeed_config(REPO / cfg.train.deepspeed_config)
    output = tmp_path / "tuned.json"
    # one timed step a probe: its peak is the same as after three (the speeds, noisier, are not under test)
    tuner = Tuner(cfg, raw, ds, TuneOptions(output=output, data=False, probe_steps=1))
    summary = tuner.run()
    probed = [t for t in tuner.trials if t.peak is not None]
    assert len({t.candidate.micro_batch for t in probed}) >= 2  # the slope needs two sizes
    for t in probed:
        assert abs(t.est_peak / t.peak - 1) <= 0.15, (t.candidate.name(), t.est_peak, t.peak)
    trials = json.loads((tmp_path / "tuned.trials.json").read_text())
    assert {row["verdict"] for row in trials["trials"]} <= {"chosen", "fits", "slower", "over_limit", "oom"}
    assert sum(row["verdict"] == "chosen" for row in trials["trials"]) == 1
    # the tuned config keeps the global batch and trains the chosen layout
    tuned = load_config(output)
    layout = batch_layout(tuned, 1)
    chosen = summary["chosen"]
    assert layout.global_batch == 64
    assert (layout.micro_batch, layout.grad_accum_steps) == (
        chosen["micro_batch"],
        chosen["grad_accum_steps"],
    )
    assert json.loads(output.read_text())["tuned"]["why"]["train.max_micro_batch"].startswith(
        str(chosen["micro_batch"])
    )
    assert load_deepspeed_config(tuned.train.deepspeed_config)["zero_optimization"]["stage"] == 0

    # a search that died during a probe goes on without it when run again (its other probes kept)
    trials["in_flight"] = chosen_name = next(
        t.candidate.name() for t in tuner.trials if t.verdict == "chosen"
    )
    for row in trials["trials"]:
        if row["name"] == chosen_name:
            row.update(probed=False, peak_gib=None, samples_per_s=None)
    (tmp_path / "tuned.trials.json").write_text(json.dumps(trials))
    again = Tuner(cfg, raw, ds, TuneOptions(output=output, data=False, probe_steps=1))
    again.run()
    died = next(t for t in again.trials if t.candidate.name() == chosen_name)
    assert died.verdict == "oom" and "ended during this probe" in died.why
    kept = {t.candidate.name(): t.peak for t in again.trials if t.peak is not None}
    assert kept == {t.candidate.name(): t.peak for t in probed if t.candidate.name() != chosen_name} | kept


def test_an_out_of_memory_probe_frees_what_it_held(toy, tmp_path):
    """The engines the failed probe made are gone after it (not those of earlier tests in this process,
    which never destroy theirs: DeepSpeed's gradient hooks keep an engine alive until ``destroy``)."""
    import weakref

    from deepspeed.runtime.engine import DeepSpeedEngine

    cfg = load_config(REPO / "configs/toy.json", toy_overrides(toy, tmp_path / "run"))
    ds = load_deepspeed_config(REPO / cfg.train.deepspeed_config)
    candidate = Candidate(16, 2, "micro", False, 0, 1)
    shape = dict(image_shape=(3, 64, 64), context_length=32, output_dir=str(tmp_path / "probe"))
    earlier = weakref.WeakSet(o for o in _objects() if isinstance(o, DeepSpeedEngine))
    # over the limit in the first forward (the engine built): 16 pairs of 64 px need ~180 MiB in all
    failed = model_probe(cfg, ds, candidate, limit=48 * MIB, steps=1, **shape)
    assert failed.oom and failed.peak is None and "over the limit of 48.0 MiB" in failed.detail
    made = [o for o in _objects() if isinstance(o, DeepSpeedEngine) and o not in earlier]
    assert not made  # the half-built engine too
    with StorageTracker(keep_peak_tensors=False) as after:
        ok = model_probe(cfg, ds, candidate, limit=None, steps=1, **shape)
    assert not ok.oom and ok.step_s > 0
    assert after.current < 4 * MIB  # what the second probe made is gone with it


def _objects():
    import gc
    import warnings

    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(gc.get_objects())


# ---- planning a cluster run, and DeepSpeed's autotuner ------------------------------------------------


def test_estimate_only_plans_the_laion_preset_for_8_and_32_gpus_keeping_its_batch(tmp_path):
    path = REPO / "configs/laion_vitb16_fastclip_v3.json"
    cfg, raw = load_config(path), read_raw_config(path)
    ds = load_deepspeed_config(REPO / cfg.train.deepspeed_config)
    chosen = {}
    for gpus in (8, 32):
        for memory in (40, 80):
            output = tmp_path / f"plan_{gpus}x{memory}.json"
            opts = TuneOptions(output=output, estimate_only=True, gpus=gpus, gpu_memory_gib=memory)
            summary = Tuner(cfg, raw, ds, opts).run()
            plan = load_config(output)
            layout = batch_layout(plan, gpus)
            assert layout.global_batch == 5120 == cfg.train.global_batch
            assert summary["estimates_only"] and summary["chosen"]["peak_gib"] is None
            assert summary["chosen"]["est_peak_gib"] <= 0.9 * memory
            assert summary["chosen"]["contrastive_batch"] == 5120  # the reference's, in 40 GiB as in 80
            rows = json.loads(output.with_name(output.stem + ".trials.json").read_text())["trials"]
            assert all(r["peak_gib"] is None and r["samples_per_s"] is None for r in rows)
            over = [r for r in rows if r["verdict"] == "over_limit"]
            assert all(r["est_peak_gib"] > 0.9 * memory for r in over)
            chosen[gpus, memory] = summary["chosen"]
    # more memory never makes the plan need more recomputation or accumulation
    for gpus in (8, 32):
        small, large = chosen[gpus, 40], chosen[gpus, 80]
        assert large["grad_accum_steps"] <= small["grad_accum_steps"]
        assert large["grad_checkpointing"] <= small["grad_checkpointing"]


def test_train_refuses_a_deepspeed_json_that_enables_the_autotuner(tmp_path):
    from eva_fastclip.config import ConfigError
    from eva_fastclip.plan.deepspeed_json import resolve_deepspeed_config

    cfg = load_config(REPO / "configs/toy.json")
    ds = load_deepspeed_config(REPO / cfg.train.deepspeed_config)
    ds["autotuning"] = {"enabled": True, "fast": True}
    with pytest.raises(ConfigError, match="autotuner.*eva-fastclip tune"):
        resolve_deepspeed_config(ds, cfg, batch_layout(cfg, 2), source="ds.json")


def test_bad_requests_are_refused_before_any_probe(toy, tmp_path):
    from eva_fastclip.config import ConfigError
    from eva_fastclip.tune.options import cap_reduce_bucket, check_tunable

    with pytest.raises(ConfigError, match="--gpus N and --gpu-memory-gib"):
        TuneOptions(output=tmp_path / "t.json", estimate_only=True)
    with pytest.raises(ConfigError, match="add --estimate-only"):
        TuneOptions(output=tmp_path / "t.json", gpus=8)
    with pytest.raises(ConfigError, match="must name a .json file"):
        TuneOptions(output=tmp_path / "tuned")
    with pytest.raises(ConfigError, match="--probe-steps must be >= 1, got 0"):
        TuneOptions(output=tmp_path / "t.json", probe_steps=0)
    with pytest.raises(ConfigError, match="fixes train_micro_batch_size_per_gpu=32.*auto"):
        check_tunable({"train_micro_batch_size_per_gpu": 32}, "ds.json")
    capped, note = cap_reduce_bucket({"zero_optimization": {"stage": 1}}, 7_981_057)
    assert capped["zero_optimization"]["reduce_bucket_size"] == 8_000_000 and "5e+08 -> 8e+06" in note
    assert cap_reduce_bucket({"zero_optimization": {"reduce_bucket_size": 1000}}, 10**6)[1] is None
    # a limit nothing fits: one error naming the smallest layout's need, after the estimates alone
    overrides = toy_overrides(toy, tmp_path / "run")
    cfg, raw = (
        load_config(REPO / "configs/toy.json", overrides),
        read_raw_config(REPO / "configs/toy.json", overrides),
    )
    ds = load_deepspeed_config(REPO / cfg.train.deepspeed_config)
    tiny = TuneOptions(output=tmp_path / "tiny.json", memory_limit_gib=0.01, data=False)
    with pytest.raises(ConfigError, match=r"no layout of the global batch 64 fits 0\.01 GiB.*needs"):
        Tuner(cfg, raw, ds, tiny).run()
    rows = json.loads((tmp_path / "tiny.trials.json").read_text())["trials"]
    assert {r["verdict"] for r in rows} == {"over_limit"} and not any(r["probed"] for r in rows)
