"""Benchmarks (docs/benchmarks.md): `eva-fastclip bench-speed` times our training step against
OpenCLIP's; `eva-fastclip bench-loss` measures the loss step's memory and collective traffic against
OpenCLIP's ClipLoss; `eva-fastclip bench-lamb` times LAMB's optimizer step per tensor against per ZeRO
partition; `eva-fastclip bench-data` measures our training loader against OpenCLIP's on the same shards."""

from eva_fastclip.bench.speed import format_report, run_speed_benchmark

__all__ = ["format_report", "run_speed_benchmark"]
