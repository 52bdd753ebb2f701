"""Training precision: what the hardware computes natively, and what a run asks for.

``train.precision`` is ``auto``, ``bf16``, ``fp16`` or ``fp32``; the DeepSpeed JSON may also say
``"enabled": "auto"`` in its ``bf16`` / ``fp16`` sections (or leave them out), or fix one. ``auto`` picks

- bf16 where the device computes it natively: a CUDA device with bf16 support (Ampere and newer), or a CPU
  with AVX-512 BF16 or AMX;
- fp16 with dynamic loss scaling on CUDA devices without bf16 (V100, T4);
- fp32 elsewhere: on a CPU with only AVX2 a bf16 matmul is emulated and runs ~30x slower than fp32.

An explicit choice is kept, with a warning where the device only emulates it.
"""

from __future__ import annotations

import functools
import json
import os
import platform
from dataclasses import dataclass
from typing import Any

from eva_fastclip.config import PRECISIONS, ConfigError

#: DeepSpeed's fp16 section when fp16 is chosen and the JSON gives no settings of its own: dynamic loss
#: scaling as in EVA-CLIP (SPEC.md: initial scale 2^16, window 1000, hysteresis 2, min 1).
FP16_DEFAULTS: dict[str, Any] = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
#: oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below the first one with native bf16 dot products.
_ONEDNN_ISAS_WITHOUT_BF16 = {
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
}


@dataclass(frozen=True, slots=True)
class PrecisionChoice:
    name: str
    """bf16, fp16 or fp32."""
    reason: str
    """Why, in words, for the start-up log."""
    warning: str | None = None
    """Set when the device only emulates the chosen precision."""


@dataclass(frozen=True, slots=True)
class Hardware:
    """What decides the precision: the device kind and whether it computes bf16 natively."""

    cuda: bool
    native_bf16: bool
    description: str


def detect_hardware() -> Hardware:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return Hardware(cuda=True, native_bf16=native, description=f"CUDA device {name}")
    native, description = cpu_bf16_support()
    return Hardware(cuda=False, native_bf16=native, description=description)


def common_hardware(hardware: Hardware) -> Hardware:
    """The hardware every rank of the process group shares: ranks on different devices (a mixed cluster)
    must still train in one precision, so bf16 counts as native only where it is native on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return hardware
    everyone: list[Hardware | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, hardware)
    if all(other.native_bf16 for other in everyone) or not hardware.native_bf16:
        return hardware
    slower = next(other for other in everyone if not other.native_bf16)
    return Hardware(
        hardware.cuda, False, f"{hardware.description}, but another rank runs on {slower.description}"
    )


@functools.cache
def cpu_bf16_support() -> tuple[bool, str]:
    """(native bf16, description) for this CPU, from /proc/cpuinfo's flags.

    The kernels that run bf16 matmuls honour two caps, so this does too: oneDNN's ``ONEDNN_MAX_CPU_ISA``
    and ATen's ``ATEN_CPU_CAPABILITY``. Setting both to AVX2 makes a bf16-capable CPU behave (and be
    treated) like an AVX2-only one.
    """
    import torch

    flags = _cpu_flags()
    bf16_flags = sorted(flags & {"avx512_bf16", "amx_bf16"})
    capability = torch.backends.cpu.get_cpu_capability()
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if not bf16_flags:
        isa = "AVX2" if "avx2" in flags else capability
        return False, f"CPU ({isa}; no AVX-512 BF16 or AMX)"
    if onednn_cap in _ONEDNN_ISAS_WITHOUT_BF16:
        return False, f"CPU with {'/'.join(bf16_flags)}, capped by ONEDNN_MAX_CPU_ISA={onednn_cap}"
    if not capability.startswith("AVX512"):
        return False, f"CPU with {'/'.join(bf16_flags)}, capped by ATen capability {capability}"
    return True, f"CPU with {'/'.join(bf16_flags)}"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()  # not Linux: assume no native bf16 (fp32 is always correct)


def cpu_model() -> str:
    """The processor's name as /proc/cpuinfo gives it (tune's report and the benchmarks record it)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def precision_in_deepspeed_json(ds: dict[str, Any], source: str) -> str:
    """``auto``, ``bf16``, ``fp16`` or ``fp32`` as the DeepSpeed JSON's bf16 / fp16 sections say it.

    A missing section or ``"enabled": "auto"`` leaves the choice open; ``"enabled": false`` in every
    section present fixes fp32.
    """
    if "bfloat16" in ds:  # DeepSpeed's legacy name: it would lose to the "bf16" section we write
        raise ConfigError(f'{source}: rename its "bfloat16" section to "bf16"')
    states = {}
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        if section is None:
            continue
        enabled = section.get("enabled", False) if isinstance(section, dict) else section
        if enabled not in (True, False, "auto"):
            raise ConfigError(f'{source}: {name}.enabled must be true, false or "auto", got {enabled!r}')
        states[name] = enabled
    on = [name for name, enabled in states.items() if enabled is True]
    if len(on) == 2:
        raise ConfigError(f"{source} enables both fp16 and bf16: keep one")
    if on:
        return on[0]
    if not states or "auto" in states.values():
        return "auto"
    return "fp32"


def choose_precision(requested: str, in_json: str, hardware: Hardware, *, source: str) -> PrecisionChoice:
    """Reconcile ``train.precision`` with the DeepSpeed JSON and pick for ``hardware``."""
    if requested not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {PRECISIONS}, got {requested!r}")
    if requested != "auto" and in_json != "auto" and requested != in_json:
        raise ConfigError(
            f"train.precision={requested} but {source} fixes {in_json}: set train.precision=auto, "
            f'or write "enabled": "auto" in the JSON\'s bf16 and fp16 sections'
        )
    explicit = requested if requested != "auto" else in_json
    where = hardware.description
    if explicit == "auto":
        if hardware.native_bf16:
            return PrecisionChoice("bf16", f"auto: {where} computes bf16 natively")
        if hardware.cuda:
            return PrecisionChoice(
                "fp16", f"auto: {where} has no native bf16; fp16 with dynamic loss scaling"
            )
        return PrecisionChoice("fp32", f"auto: {where} would only emulate bf16 (~30x slower matmuls)")
    origin = "train.precision" if requested != "auto" else source
    if explicit == "fp16" and not hardware.cuda:
        raise ConfigError(
            f"{origin} asks for fp16, which DeepSpeed supports only on CUDA devices; on CPU set "
            "train.precision=auto (or bf16 / fp32) with a JSON such as ds_configs/zero1_lamb.json"
        )
    warning = None
    if explicit == "bf16" and not hardware.native_bf16:
        warning = (
            f"bf16 was asked for ({origin}) but {where} only emulates it: steps will be much slower than "
            "fp32; set train.precision=auto to choose by hardware"
        )
    return PrecisionChoice(explicit, f"{origin} asks for {explicit} ({where})", warning)


def apply_precision(
    ds: dict[str, Any], choice: PrecisionChoice, *, source: str = "the DeepSpeed JSON"
) -> None:
    """Write the choice into the DeepSpeed JSON (in place): one section enabled, the other off; bf16 by
    autocast where the JSON's ``torch_autocast`` section asks for it (:func:`bf16_by_autocast`)."""
    autocast = bf16_by_autocast(ds, source) and choice.name == "bf16"
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        section = dict(section) if isinstance(section, dict) else {}
        enabled = choice.name == name and not autocast
        if enabled and name == "fp16":
            section = {**FP16_DEFAULTS, **section}
        section["enabled"] = enabled
        ds[name] = section
    if AUTOCAST in ds:
        ds[AUTOCAST] = {**ds[AUTOCAST], "enabled": autocast, "dtype": "bfloat16"}


#: DeepSpeed's section for torch.autocast over fp32 weights
AUTOCAST = "torch_autocast"


def bf16_by_autocast(ds: dict[str, Any], source: str) -> bool:
    """Whether bf16 runs as OpenCLIP's amp_bf16 does: fp32 weights in the module, the forward under
    ``torch.autocast(bfloat16)``, the optimizer stepping the weights themselves (DeepSpeed's
    ``torch_autocast`` section), rather than DeepSpeed's bf16: a bf16 module beside fp32 master copies.

    ``"torch_autocast": {"enabled": "auto"}`` (or true) asks for it, at ZeRO stage 0 only: with the whole
    optimizer state on every rank nothing needs a copy of the weights, so the step after the backward is
    the optimizer's alone (engine/setup.py); ZeRO-1/2 keep DeepSpeed's bf16, whose bf16 module is what
    makes them smaller. fp16 always runs as DeepSpeed's fp16 (its loss scaling).
    """
    section = ds.get(AUTOCAST)
    if section is None:
        return False
    enabled = section.get("enabled", False) if isinstance(section, dict) else section
    if enabled not in (True, False, "auto"):
        raise ConfigError(f'{source}: {AUTOCAST}.enabled must be true, false or "auto", got {enabled!r}')
    dtype = section.get("dtype", "bfloat16") if isinstance(section, dict) else "bfloat16"
    if enabled is not False and dtype not in ("bfloat16", "bf16"):
        raise ConfigError(
            f"{source}: {AUTOCAST}.dtype={dtype!r}: eva_fastclip runs autocast in bfloat16 only (fp16 needs "
            f'loss scaling: use the "fp16" section)'
        )
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if enabled is True and stage != 0:
        raise ConfigError(
            f"{source} enables {AUTOCAST} at ZeRO stage {stage}: autocast over fp32 weights is for stage "
            '0 (docs/configuration.md, Precision); write "enabled": "auto" to use DeepSpeed\'s bf16 at '
            "stages 1-2"
        )
    return enabled is not False and stage == 0


def at_stage(ds: dict[str, Any], stage: int) -> dict[str, Any]:
    """A copy of the DeepSpeed JSON ``ds`` at ZeRO ``stage``; at stage 0 with bf16 by autocast unless the
    JSON has a ``torch_autocast`` section of its own (what ``eva-fastclip tune`` probes and writes)."""
    ds = json.loads(json.dumps(ds))
    ds.setdefault("zero_optimization", {})["stage"] = stage
    if stage == 0:
        ds.setdefault(AUTOCAST, {"enabled": "auto", "dtype": "bfloat16"})
    return ds


def runs_by_autocast(ds: dict[str, Any]) -> bool:
    """Whether a resolved DeepSpeed JSON trains by autocast over fp32 weights."""
    section = ds.get(AUTOCAST)
    return isinstance(section, dict) and section.get("enabled") is True


def for_resume(
    choice: PrecisionChoice, saved: str | None, *, explicit: bool, checkpoint: str
) -> PrecisionChoice:
    """The precision a resumed run trains in: the checkpoint's. DeepSpeed keeps its optimizer state in
    files that differ by precision (``bf16_zero_pp_rank_*`` against ``zero_pp_rank_*``), so a run moved to
    hardware where ``auto`` would choose otherwise goes on in the precision it was trained in; an explicit
    choice that differs stops the run before step 1."""
    if saved is None or saved == choice.name:
        return choice
    if explicit:
        raise ConfigError(
            f"{checkpoint} was trained in {saved}, but this run asks for {choice.name}: DeepSpeed cannot "
            f"resume another precision's optimizer state; set train.precision={saved} or auto"
        )
    if saved == "fp16" and "CUDA" not in choice.reason:
        raise ConfigError(f"{checkpoint} was trained in fp16, which DeepSpeed runs only on CUDA devices")
    warning = None
    if saved == "bf16":
        warning = f"resuming in bf16 where auto would choose {choice.name}: steps may be much slower"
    return PrecisionChoice(saved, f"the checkpoint's: {checkpoint} was trained in {saved}", warning)
