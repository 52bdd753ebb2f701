"""The training log's throughput (eva_fastclip/engine/throughput.py): the peak table and its matching, each
window's samples/s, TFLOP/s and MFU, the unmasked final phase's FLOPs, the run's means; and a run's logs:
TensorBoard, the step log's window lines, final_metrics.json and the start-up line."""

import json
import logging

import pytest
import torch
from stand_ins import StandInBatches, toy_config, toy_trainer

from eva_fastclip.engine.throughput import PEAK_TFLOPS, THROUGHPUT_KEYS, Peak, Throughput, device_row
from eva_fastclip.models.flops import ModelFlops


@pytest.mark.parametrize(
    "name, row",
    [
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("Tesla V100-SXM2-32GB", None),
        ("cpu (AMD EPYC 7B13)", None),
    ],
)
def test_device_names_find_their_row(name, row):
    assert device_row(name) == row


def test_the_table_is_dense_bf16_and_fp16_alike():
    assert PEAK_TFLOPS["A100"]["bf16"] == 312.0 and PEAK_TFLOPS["H100 SXM"]["bf16"] == 989.4
    assert PEAK_TFLOPS["H200 SXM"] == PEAK_TFLOPS["H100 SXM"]  # the same GH100 die, more memory
    for row in PEAK_TFLOPS.values():
        assert row["bf16"] == row["fp16"] > row["tf32"] > row["fp32"]


def test_the_peak_comes_from_the_config_else_the_table_else_nowhere():
    cpu = torch.device("cpu")
    assert Peak.find(2.5, cpu, "fp32") == Peak(2.5, "train.peak_tflops")
    none = Peak.find(None, cpu, "bf16")
    assert none.tflops is None and none.source.startswith("no peak known for cpu (")


FLOPS = ModelFlops(vision_forward=2e9, text_forward=1e9, vision_training=6e9, text_training=3e9)
UNMASKED = ModelFlops(vision_forward=4e9, text_forward=1e9, vision_training=12e9, text_training=3e9)


def test_a_window_gives_samples_tflops_and_mfu_per_rank():
    """10 steps of 64 pairs a rank in 4 s: 160 samples/s, 160 x 9 GFLOP = 1.44 TFLOP/s, against 14.4: 10%."""
    throughput = Throughput(FLOPS, None, samples_per_step=64, peak=Peak(14.4, "test"))
    figures = throughput.window(steps=10, seconds=4.0, last_step=10)
    assert figures == {
        "perf/samples_per_s_per_rank": pytest.approx(160.0),
        "perf/tflops_per_rank": pytest.approx(1.44),
        "perf/mfu": pytest.approx(0.1),
    }
    assert set(figures) == set(THROUGHPUT_KEYS)
    assert "perf/mfu" not in Throughput(FLOPS, None, 64, Peak(None, "none")).window(10, 4.0, 10)
    assert throughput.window(0, 0.0, 10) == {}  # no step in the window: no figures


def test_a_model_the_count_cannot_trace_still_logs_its_samples(monkeypatch):
    """The count fails (an architecture it cannot trace): the run goes on, samples/s without TFLOP/s."""
    from eva_fastclip.config import ExperimentConfig
    from eva_fastclip.engine import throughput as module

    def fails(*args, **kwargs):
        raise ValueError("no forward on meta tensors")

    monkeypatch.setattr(module, "model_flops", fails)
    throughput = Throughput.for_run(ExperimentConfig(), 8, torch.device("cpu"), "fp32")
    assert throughput.flops is None and "ValueError: no forward on meta tensors" in throughput.describe()
    assert throughput.window(steps=2, seconds=1.0, last_step=2) == {"perf/samples_per_s_per_rank": 16.0}
    assert throughput.summary_line() == "throughput over 2 steps (1.0 s of step time): 16 samples/s per rank"


def test_the_unmasked_final_phase_counts_its_own_flops():
    """Steps 9 and 10 of a window 1-10 without masking: 8 x 9 + 2 x 15 GFLOP a sample."""
    throughput = Throughput(FLOPS, UNMASKED, samples_per_step=1, peak=Peak(None, "none"))
    assert throughput.step_flops(1, 10) == pytest.approx(10 * 9e9)
    throughput.unmasked_from = 9
    assert throughput.step_flops(1, 10) == pytest.approx(8 * 9e9 + 2 * 15e9)
    assert throughput.step_flops(11, 12) == pytest.approx(2 * 15e9)
    assert throughput.step_flops(1, 8) == pytest.approx(8 * 9e9)


def test_the_runs_means_weigh_the_windows_by_their_time():
    throughput = Throughput(FLOPS, None, samples_per_step=10, peak=Peak(1.0, "test"))
    assert throughput.summary() == {} and throughput.summary_line() is None
    throughput.window(steps=10, seconds=1.0, last_step=10)  # 100 samples/s
    throughput.window(steps=10, seconds=3.0, last_step=20)  # 33 samples/s
    summary = throughput.summary()
    assert summary["samples_per_s_per_rank"] == pytest.approx(200 / 4.0)
    assert summary["tflops_per_rank"] == pytest.approx(200 * 9e9 / 4.0 / 1e12)
    assert summary["mfu"] == pytest.approx(summary["tflops_per_rank"])
    assert summary["steps"] == 20 and summary["seconds"] == 4.0 and summary["gflop_per_sample"] == 9.0
    assert "50 samples/s per rank" in throughput.summary_line()


def test_a_run_logs_its_throughput(tmp_path, caplog):
    """Windows of 2 steps: TensorBoard's perf/* and the step log's lines of steps 2 and 4 carry the
    throughput, the others none; the run's means end in final_metrics.json and the log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = toy_config(
        tmp_path, "train.steps=4", "train.log_every_steps=2", "train.batch_size=8", "train.peak_tflops=0.001"
    )
    with caplog.at_level(logging.INFO, logger="eva_fastclip.engine.trainer"):
        trainer = toy_trainer(cfg, loader=StandInBatches(4, 8))
        trainer.train()
    flops = trainer.throughput.flops.training
    assert "GFLOP per training sample" in caplog.text and "peak of 0.001 TFLOP/s per rank" in caplog.text
    assert "throughput over 4 steps" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [set(THROUGHPUT_KEYS) <= r.keys() for r in records] == [False, True, False, True]
    for record in records[1::2]:
        samples = record["perf/samples_per_s_per_rank"]
        assert record["perf/tflops_per_rank"] == pytest.approx(samples * flops / 1e12)
        assert record["perf/mfu"] == pytest.approx(record["perf/tflops_per_rank"] / 0.001)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("perf/mfu")}
    assert logged == {2: pytest.approx(records[1]["perf/mfu"]), 4: pytest.approx(records[3]["perf/mfu"])}
    final = json.loads((tmp_path / "final_metrics.json").read_text())
    assert final["step"] == 4 and final["throughput"]["steps"] == 4
    assert final["throughput"]["mfu"] == pytest.approx(final["throughput"]["tflops_per_rank"] / 0.001)
