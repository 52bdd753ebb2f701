"""``train.compile``: the vision and text towers compiled with ``torch.compile``.

The towers' entry points, ``model.encode_image`` and ``model.encode_text`` (open_clip's CLIP and
CustomTextCLIP alike: their forward calls both), are replaced on the model instance by their compiled
selves. The modules, their parameters and the state dict's keys stay as they are (no ``_orig_mod.`` in a
checkpoint or an export), and DeepSpeed's engine, the loss and the optimizer see nothing different.

Shapes are static (``dynamic=False``): a micro-batch has a fixed size and masking keeps a fixed number of
tokens (models/masking.py: ``max(1, int(L·(1−p)))``), so each graph compiles once: a tower in training,
and without autograd for pass 1 of a cached step; the unmasked final phase compiles once more. Every
compiled frame is counted (:class:`CompileWatch`) and the trainer logs the count after step 2 as
``compile/recompiles``, which stays 0 in a run. Past dynamo's recompile limit a recompile raises instead of
falling back to eager, and a tower that cannot compile raises :class:`CompileFailed` naming it at its first
call, before the first step is taken: nothing runs eagerly in silence. Evaluations run the towers eagerly
(:func:`eagerly`): their batch sizes vary, and they are not the hot path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from eva_fastclip.config import ConfigError

log = logging.getLogger(__name__)

#: the towers' entry points on open_clip's models
TOWERS = ("encode_image", "encode_text")


class CompileFailed(ConfigError):
    """A tower could not be compiled: the run stops (train.compile=false trains it eagerly)."""


def compile_problem(device: torch.device) -> str | None:
    """Why ``train.compile`` cannot work on this machine, or None: checked before anything is built."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as err:  # noqa: BLE001 (whatever the probe raises, it names the missing compiler)
            return f"torch.compile's CPU code needs a C++ compiler: {err}"
    return None


def compile_towers(model: nn.Module, backend: str = "inductor") -> list[str]:
    """Replace ``model``'s towers by their compiled selves (in place); returns the towers compiled."""
    import torch._dynamo

    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never fall back to eager in silence
    done = []
    for name in TOWERS:
        method = getattr(model, name, None)
        if method is None:
            continue
        setattr(model, name, _compiled(method, name, backend))
        done.append(name)
    if not done:
        raise CompileFailed(f"train.compile: {type(model).__name__} has none of {TOWERS} to compile")
    return done


def _compiled(method: Callable, name: str, backend: str) -> Callable:
    compiled = torch.compile(method, dynamic=False, backend=backend)

    @functools.wraps(method)
    def run(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            cause = getattr(err, "inner_exception", None) or err.__cause__ or err
            reason = (str(cause).strip().splitlines() or [""])[0]  # dynamo appends pages of advice
            raise CompileFailed(
                f"train.compile: {name} could not be compiled ({type(cause).__name__}: {reason}); set "
                "train.compile=false to train it eagerly"
            ) from err

    return run


@contextlib.contextmanager
def eagerly() -> Iterator[None]:
    """Within the block compiled towers run eagerly (evaluations: their batch sizes vary)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (each graph, recompiles included)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


class CompileWatch:
    """The frames compiled by the end of this process's first ``warmup`` optimizer steps (every graph a
    step uses), and the recompiles after them, which the trainer logs."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup, self.steps = warmup, 0
        self.baseline: int | None = None

    def step_ended(self) -> dict[str, float]:
        """The step's ``compile/*`` metrics: graphs compiled, and the recompiles since the warm-up."""
        self.steps += 1
        frames = compiled_frames()
        if self.baseline is None and self.steps >= self.warmup:
            self.baseline = frames
            log.info("train.compile: %d graph(s) compiled in the first %d steps", frames, self.steps)
        recompiles = 0 if self.baseline is None else frames - self.baseline
        return {"compile/graphs": float(frames), "compile/recompiles": float(recompiles)}
