"""Sharded checkpoints that a crash or a kill cannot corrupt, and their conversion for another rank count.

DeepSpeed's ``save_checkpoint`` writes each rank's shards non-atomically and its ``latest`` file before
every rank is done. So every save goes into a staging folder ``checkpoints/step_00000123.saving``: every
rank writes its files there and fsyncs them, then rank 0 writes our marker ``COMPLETE.json`` (temporary
file, fsync, atomic rename) and renames the folder to ``step_00000123``. A folder counts only with its
marker; a save of a step that already has a complete folder replaces it only once the new one is
complete, and a crash in between leaves one of the two complete (``recover`` finishes the swap). Old
checkpoints are deleted only after a newer one is complete. "Newer" is the order the saves completed in
(the marker's ``sequence``), so a rerun's checkpoints supersede those an earlier run left behind.

ZeRO checkpoints hold one partition of the optimizer per rank. Resuming on another number of ranks goes
through DeepSpeed's universal checkpoint: ``convert_to_universal`` writes ``step_00000123.universal``
beside the original (once; it is reused) and ``load_checkpoint`` loads it with ``load_universal``, and
the rest of the module (frozen parameters, persistent buffers) from the original's saved module. The
original stays as it is: it holds every rank's own files, which no other layout can replace.

A save that fails (no space left, a file too large, any write error of the OS) on any rank fails on every
rank together: the ranks agree on it before the marker, the staging folder is removed, and every rank
raises :class:`CheckpointWriteError` naming the folder, the error and the bytes a checkpoint takes beside
the space left. The previous complete checkpoint and ``latest`` are untouched; the run stops. A write
DeepSpeed's save makes fails without raising out of it (its save ends with a barrier every rank must reach).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import logging
import os
import re
import shutil
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eva_fastclip.config import ConfigError

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
RANK_STATE = "rank_state"  # one file per rank: its RNG states and its data position
UNIVERSAL = ".universal"
_STAGING, _REPLACED, _DELETING = ".saving", ".replaced", ".deleting"
_TAG = re.compile(r"^step_(\d{8,})$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written on some rank; nothing of it was left, the last one is intact."""


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / MARKER).is_file()


class CorruptCheckpoint(ConfigError):
    """A checkpoint's file that cannot be read: the message names it (exit code 2, before step 1)."""


def read_marker(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / MARKER
    try:
        marker = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise corrupt(path, f"not valid JSON: {err}") from None
    if not isinstance(marker, dict):
        raise corrupt(path, "not a checkpoint's marker (not a JSON object)")
    return marker


def load_file(path: Path, **kwargs) -> Any:
    """``torch.load`` of a checkpoint's file; one truncated or damaged is named (CorruptCheckpoint)."""
    with naming_damage(path, "truncated or damaged"):
        return torch.load(path, map_location="cpu", weights_only=False, **kwargs)


@contextlib.contextmanager
def naming_damage(path: Path, what: str) -> Iterator[None]:
    """Within the block, torch.load's failure on a file cut short or damaged is raised again as a
    CorruptCheckpoint naming ``path`` as ``what``; any other error passes unchanged."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 (named below when it is the file's fault, else re-raised)
        if not unreadable(err):
            raise
        raise corrupt(path, f"{what} ({type(err).__name__}: {err})") from None


def unreadable(err: BaseException) -> bool:
    """Whether ``err`` is torch.load's way of saying its file is cut short or not a checkpoint file."""
    import pickle

    if isinstance(err, (EOFError, pickle.UnpicklingError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("PytorchStreamReader" in text or "zip archive" in text)


def corrupt(path: Path, what: str) -> CorruptCheckpoint:
    """The one line that names a checkpoint file that cannot be read, and the way out."""
    return CorruptCheckpoint(
        f"{path} is {what}: the checkpoint {path.parent} cannot be trusted; resume from another one "
        "(--resume FOLDER) or move it out of the checkpoints folder"
    )


def complete_checkpoints(root: Path) -> list[Path]:
    """Marked checkpoint folders under ``root``, oldest first: in the order their saves completed
    (markers without a ``sequence``, written before it existed, come first, by step)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _TAG.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: (read_marker(p).get("sequence", 0), int(_TAG.match(p.name).group(1))))


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    """``latest`` → the checkpoint saved last under ``root`` (None if there is none yet); a path → itself.

    A path to a checkpoint without our marker is refused: it may be a partially written save.
    """
    if resume is None:
        return None
    if resume == "latest":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint folder")
    if not is_complete(path):
        raise ValueError(
            f"--resume {resume}: the folder has no {MARKER}, so its save never finished (a crash or kill "
            f"during saving); resume from an earlier checkpoint, e.g. --resume latest"
        )
    return path


def recover(root: Path) -> None:
    """Finish what a crash interrupted under ``root``; rank 0 alone, before anyone reads the folder.

    A complete staging folder is swapped into place (its save completed, the rename did not), an
    incomplete one is deleted, and so are the remains of a replaced or deleted checkpoint.
    """
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.name.endswith(_DELETING):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.endswith(_STAGING):
            final = path.with_name(path.name[: -len(_STAGING)])
            if is_complete(path):
                log.info("completing the interrupted save of %s", final)
                _swap_into_place(path, final)
            else:
                shutil.rmtree(path)
    for path in sorted(root.iterdir()):
        if path.name.endswith(_REPLACED):
            final = path.with_name(path.name[: -len(_REPLACED)])
            if not final.exists() and is_complete(path):  # cannot happen with _swap_into_place; be safe
                os.replace(path, final)
            else:
                shutil.rmtree(path)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON so that readers see either the old file or the whole new one, never a torn write; the
    rename is on disk (the folder fsynced) when this returns."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then every folder bottom-up (their entries are data too)."""
    for dirpath, _, filenames in os.walk(folder, topdown=False):
        for name in filenames:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def save_checkpoint(
    engine,
    root: Path,
    step: int,
    client_state: dict[str, Any],
    keep: int,
    write_extra: Callable[[Path], None] | None = None,
    marker: dict[str, Any] | None = None,
) -> Path:
    """Every rank calls this. ``write_extra(folder)`` adds this rank's own files (per-sample state, RNG
    and data position) before the marker; ``marker`` adds fields to it. Returns the checkpoint folder once
    it is complete on disk."""
    tag = tag_for_step(step)
    final, staging = root / tag, root / (tag + _STAGING)
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        recover(root)  # also deletes a torn staging folder of this very step
    _barrier()
    failures: list[str] = []
    with _writes_recorded(engine, failures):  # DeepSpeed's save runs to its end, collectives and all
        engine.save_checkpoint(str(root), tag=staging.name, client_state=client_state, save_latest=False)
    if not failures and write_extra is not None:
        failures += _attempt(write_extra, staging)
    _raise_if_a_rank_failed(failures, root, staging)  # (a collective: every rank's files are written)
    # every rank flushes every file: on a filesystem that hosts share, only the host that wrote a file can
    # flush it, and which files DeepSpeed writes on which rank depends on its configuration
    _raise_if_a_rank_failed(_attempt(fsync_tree, staging), root, staging)
    marker_failure: list[str] = []
    if rank == 0:
        fields = {"step": step, "tag": tag, "world_size": _world_size(), "sequence": _next_sequence(root)}
        marker_failure = _attempt(write_json_atomic, staging / MARKER, {**fields, **(marker or {})})
    _raise_if_a_rank_failed(marker_failure, root, staging)
    if rank == 0:
        replacing = final.exists()
        _swap_into_place(staging, final)
        if replacing:  # a conversion of the replaced checkpoint is stale
            _remove(universal_folder(final))
        for old in complete_checkpoints(root)[:-keep]:
            _remove(old)
            _remove(universal_folder(old))
    _barrier()
    return final


def load_checkpoint(engine, folder: Path, universal: Path | None = None) -> dict[str, Any]:
    """Load model, optimizer, scheduler and our client state from a complete checkpoint folder, or from
    its ``universal`` conversion (the engine was built with ``checkpoint.load_universal``) and what the
    conversion leaves out from the folder's saved module."""
    source = folder if universal is None else universal
    if universal is not None:
        engine.optimizer.load_hp_checkpoint_state_from_checkpoint_dir = types.MethodType(
            _load_universal_groups, engine.optimizer
        )
    with naming_damage(source, "a folder with a truncated or damaged file"):  # DeepSpeed names no file
        load_path, client_state = engine.load_checkpoint(str(source.parent), tag=source.name)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {source}")
    if universal is not None:
        _load_module_rest(engine.module, folder)
    return client_state


def saved_settings(folder: Path) -> dict[str, Any]:
    """The experiment config a checkpoint was trained with (``config``) and its DeepSpeed settings
    (``deepspeed``, checkpointing/resume_config.py): from its marker, or for a checkpoint saved before the
    marker held them, from the client state in its model states (the ZeRO stage and clipping from DeepSpeed's
    copy of its JSON; the optimizer's type and parameters are not there)."""
    marker = read_marker(folder)
    if "config" in marker:
        return {"config": marker["config"], "deepspeed": marker.get("deepspeed", {})}
    states = sorted(folder.glob("mp_rank_*_model_states.pt"))
    if not states:
        return {}
    saved = load_file(states[0], mmap=True)
    ds = saved.get("ds_config") if isinstance(saved.get("ds_config"), dict) else {}
    deepspeed = {"zero_optimization": {"stage": ds.get("zero_optimization", {}).get("stage", 0)}}
    if "gradient_clipping" in ds:
        deepspeed["gradient_clipping"] = ds["gradient_clipping"]
    return {"config": saved.get("config", {}), "deepspeed": deepspeed}


def saved_precision(folder: Path) -> str | None:
    """bf16, fp16 or fp32: what the checkpoint was trained in (its marker says; older ones, the DeepSpeed
    config inside their model states)."""
    marker = read_marker(folder)
    if "precision" in marker:
        return marker["precision"]
    states = sorted(folder.glob("mp_rank_*_model_states.pt"))
    if not states:
        return None
    ds = load_file(states[0], mmap=True).get("ds_config", {})
    if ds.get("bf16", {}).get("enabled") is True:
        return "bf16"
    return "fp16" if ds.get("fp16", {}).get("enabled") is True else "fp32"


def save_rank_state(folder: Path, rank: int, state: dict[str, Any]) -> None:
    (folder / RANK_STATE).mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / RANK_STATE / f"rank_{rank:05d}.pt")


def load_rank_state(folder: Path, rank: int) -> dict[str, Any] | None:
    """This rank's saved RNG states and data position; None for a checkpoint from before they were saved."""
    path = folder / RANK_STATE / f"rank_{rank:05d}.pt"
    # our own file (Python's and NumPy's RNG states are not tensors)
    return load_file(path) if path.is_file() else None


def needs_conversion(folder: Path, world_size: int) -> bool:
    """Whether ``folder`` holds ZeRO partitions for another number of ranks than ``world_size`` (without
    ZeRO the optimizer's state is whole in the model states file, for any number of ranks)."""
    partitioned = any(folder.glob("*zero_pp_rank_*_optim_states.pt"))
    return partitioned and read_marker(folder)["world_size"] != world_size


def universal_folder(folder: Path) -> Path:
    return folder.with_name(folder.name + UNIVERSAL)


def convert_to_universal(folder: Path) -> Path:
    """``folder``'s universal checkpoint beside it (rank 0 alone), converted once and then reused while
    ``folder`` is the same save (its marker's step, sequence and world size)."""
    target = universal_folder(folder)
    saved = read_marker(folder)
    source = {key: saved.get(key) for key in ("step", "sequence", "world_size")}
    if is_complete(target) and read_marker(target).get("source") == source:
        log.info("reusing the universal checkpoint %s", target)
        return target
    _remove(target)
    staging = target.with_name(target.name + _STAGING)
    if staging.exists():
        shutil.rmtree(staging)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    log.info("converting %s (%s ranks) to a universal checkpoint in %s", folder, saved["world_size"], target)
    args = argparse.Namespace(
        input_folder=str(folder),
        output_folder=str(staging),
        num_extract_workers=1,  # in this process: no process pool inside a rank
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # DeepSpeed saves universal_checkpoint_info only for models that declare tensor parallelism
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal(args)
    (folder.parent / "latest_universal").unlink(missing_ok=True)  # DeepSpeed's pointer: we pick folders
    fsync_tree(staging)
    write_json_atomic(staging / MARKER, {"universal_of": folder.name, "source": source})
    _swap_into_place(staging, target)
    return target


def _swap_into_place(staging: Path, final: Path) -> None:
    """Rename the complete ``staging`` folder to ``final``, replacing a folder there. A folder cannot be
    renamed over another, so the old one steps aside first: a crash leaves either the old folder or the new
    one under its name, or the new one still staged, which ``recover`` swaps in."""
    replaced = final.with_name(final.name + _REPLACED)
    if replaced.exists():
        shutil.rmtree(replaced)
    if final.exists():
        os.replace(final, replaced)
    os.replace(staging, final)
    _fsync(final.parent)
    if replaced.exists():
        shutil.rmtree(replaced)


def _remove(folder: Path) -> None:
    """Delete a folder so that no crash leaves it half deleted under its name (it could still look
    complete: the marker may be among the last files removed)."""
    if folder.exists():
        doomed = folder.with_name(folder.name + _DELETING)
        os.replace(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _next_sequence(root: Path) -> int:
    return 1 + max((read_marker(p).get("sequence", 0) for p in complete_checkpoints(root)), default=0)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        # some filesystems cannot fsync a folder: their renames are then as durable as they make them
        if not (path.is_dir() and err.errno in (errno.EINVAL, errno.EBADF, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def _load_universal_groups(self, lp_groups_name: str, checkpoint_dir: str) -> None:
    """DeepSpeed's ``load_hp_checkpoint_state_from_checkpoint_dir`` (0.19.8) for data parallelism alone
    (no tensor or expert parallelism), bound to a ZeRO-1/2 or bf16 optimizer in its place, with one fix.

    A rank may hold no fragment of a parameter group: ZeRO splits every group into one partition per rank,
    and the share of a group smaller than the ranks (the temperature's single value) is padding. DeepSpeed
    then fails with ``IndexError`` on the group's empty list of steps; here such a partition gets zero
    moments, which is what padding holds, and the group's step. The rest is DeepSpeed's: each parameter's
    fragment of fp32 weights and moments from ``zero/<name>/``, the step, the group's saved settings.
    """
    from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

    folder = os.path.join(checkpoint_dir, "zero")
    optim_sd = torch.load(os.path.join(folder, "optimizer_state.pt"), weights_only=False)
    self._load_global_state(optim_sd)  # the loss scaler (fp16) and clipping
    for group, saved, lps in zip(
        self.optimizer.param_groups, optim_sd["param_groups"], getattr(self, lp_groups_name), strict=True
    ):
        keys, steps = set(), []
        for lp in lps:
            if lp._hp_mapping is not None:
                steps.append(lp.load_hp_checkpoint_state(os.path.join(folder, self.param_names[lp]), 0, 1))
                keys.update(lp._hp_mapping.get_optim_state_keys())
        flat = group["params"][0]
        if not steps:  # this rank's partition of the group is padding
            param_dir = os.path.join(folder, self.param_names[lps[0]])
            stored = [name[: -len(".pt")] for name in os.listdir(param_dir) if name.endswith(".pt")]
            step_file = os.path.join(param_dir, "step.pt")
            steps = [torch.load(step_file, weights_only=False) if "step" in stored else None]
            for key in stored:
                if key not in ("fp32", "step"):
                    self.optimizer.state[flat][key] = torch.zeros_like(flat)
        if any(bool(step != steps[0]) for step in steps):
            raise RuntimeError(f"{checkpoint_dir}: the parameters of one group have different steps {steps}")
        if steps[0] is not None:
            self.optimizer.state[flat]["step"] = steps[0]
        map_to_flat_opt_states(flat, lps, self.optimizer.state, keys)
        group.update({key: value for key, value in saved.items() if key != "params"})
    # what torch's Optimizer.load_state_dict runs last, as the native path does (our LAMB keeps the
    # config's trust-ratio bounds that way)
    for hook in getattr(self.optimizer, "_optimizer_load_state_dict_post_hooks", {}).values():
        hook(self.optimizer)


def _load_module_rest(module: torch.nn.Module, folder: Path) -> None:
    """A universal load restores only the parameters ZeRO optimizes. The rest of the module comes from the
    checkpoint's saved module, as a native load takes it: frozen parameters (a fixed temperature, a locked
    tower) and persistent buffers (BatchNorm's running statistics and counts)."""
    params = dict(module.named_parameters())
    wanted = {name for name, p in params.items() if not p.requires_grad}
    wanted |= module.state_dict().keys() - params.keys()  # persistent buffers
    if not wanted:
        return
    states = folder / "mp_rank_00_model_states.pt"
    saved = load_file(states)["module"]
    missing = sorted(wanted - saved.keys())
    if missing:
        raise RuntimeError(f"{states} has no {', '.join(missing[:5])}: it is not this architecture's")
    current = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in wanted:
            current[name].copy_(saved[name].to(current[name].dtype))


#: what a write that the OS refused raises (torch.save reports the OS's write errors as RuntimeError)
_WRITE_ERRORS = (OSError, RuntimeError)


def _attempt(write: Callable[..., Any], *args: Any) -> list[str]:
    """``write(*args)``'s error as this rank's failure ([] when it succeeded)."""
    try:
        write(*args)
    except _WRITE_ERRORS as err:
        return [f"rank {_rank()}: {err}"]
    return []


@contextlib.contextmanager
def _writes_recorded(engine, failures: list[str]):
    """DeepSpeed's save records a refused write in ``failures`` instead of raising it, and writes nothing more
    of this save: every write it makes goes through its checkpoint engine's ``save`` and ``makedirs``, but for
    the recovery scripts rank 0 copies beside the ZeRO files (``_copy_recovery_script``, DeepSpeed 0.19).
    DeepSpeed's save ends with a barrier: a rank that raised out of it alone would leave the others waiting
    there for good while it waited for them to agree on the failure."""
    writers = [(engine.checkpoint_engine, "save"), (engine.checkpoint_engine, "makedirs")]
    if hasattr(engine, "_copy_recovery_script"):
        writers.append((engine, "_copy_recovery_script"))

    def recording(write: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> None:
            if not failures:
                failures.extend(_attempt(lambda: write(*args, **kwargs)))

        return call

    for owner, name in writers:
        setattr(owner, name, recording(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name in writers:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)  # the class's own method again


def _raise_if_a_rank_failed(failure: list[str], root: Path, staging: Path) -> None:
    """Every rank learns whether any rank's writes failed (a collective); if one did, the staging folder
    goes and every rank raises CheckpointWriteError with the first failed rank's report: its error, the size
    of a checkpoint, the space left and the likely cause as that rank sees them (a disk may be its node's)."""
    report = _failure_report(failure[0], root) if failure else None
    reports = [report]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    failed = [r for r in reports if r]
    if not failed:
        return
    _barrier()
    if _rank() == 0:
        with contextlib.suppress(OSError):
            _remove(staging)
    _barrier()
    error, details = failed[0]
    raise CheckpointWriteError(
        f"saving {staging.with_suffix('')} failed ({error}; {len(failed)} of {len(reports)} rank(s) failed); "
        f"{details}. The run stops: make room (or fix the write error), then resume with --resume latest"
    )


def _failure_report(error: str, root: Path) -> tuple[str, str]:
    """(the error, what this rank sees of the room a save needs: the last checkpoint's size, the space left on
    its file system, the likely cause). It never raises: it runs before the collective every rank must
    reach, and the error it carries is the one to report (a root this node never made, or a damaged
    marker, only leave the details out)."""
    try:
        return error, _room_seen(root)
    except Exception as err:  # noqa: BLE001 (see above)
        return error, f"what is left on the file system of {root} cannot be read here ({err})"


def _room_seen(root: Path) -> str:
    complete = complete_checkpoints(root)
    size = sum(p.stat().st_size for p in complete[-1].rglob("*") if p.is_file()) if complete else None
    if complete:
        needed = f"the last complete checkpoint, {complete[-1]}, takes {_size(size)} and is intact"
    else:
        needed = "there is no complete checkpoint yet"
    free = shutil.disk_usage(root).free
    return f"{needed}; {_size(free)} are left on the file system of {root}{_likely_cause(size, free)}"


def _likely_cause(size: int | None, free: int) -> str:
    """What torch.save's own message hides: no space, or a limit on the size of a file."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f"; rank {_rank()} may write at most {_size(limit)} to a file (RLIMIT_FSIZE, ulimit -f)"
    if size is not None and free < size:
        return f"; less than a checkpoint's {_size(size)}: the file system is full"
    return ""


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
