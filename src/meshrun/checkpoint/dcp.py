"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic, retained, reshardable.

Layout: `<run_dir>/checkpoints/step-00000010/` (DCP files, config.json, manifest.json) and
`latest` (a text file naming the checkpoint saved last).
Every saved value is a tensor keyed by its model-wide name, so any dp x pp layout can load any
other's checkpoint (DCP reshards; replicated dp copies are written once). A save goes to a
`.tmp` folder that rank 0 renames only after every rank finished writing, then `latest` moves.

Loading never unpickles arbitrary objects: tensors are read with `weights_only=True` by DCP, and
DCP's pickled `.metadata` index is read with an unpickler that admits only DCP's own classes for
what meshrun writes: tensor entries. A bytes entry (which DCP's planner would `torch.load` with
`weights_only=False`) or a transformed (compressed) one is refused with the index's name.
A manifest of sizes and crc32s turns truncated or corrupt files into errors that name the file.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshrun.checkpoint.paths import (
    CONFIG,
    LATEST,
    MANIFEST,
    checkpoint_root,
    complete_checkpoints,
    step_of,
)
from meshrun.checkpoint.safe_reader import SafeReader
from meshrun.errors import CheckpointError, DamagedCheckpointError, RunError
from meshrun.files.atomic import atomic_target, disk_error, publish_folder, write_atomic
from meshrun.files.json_reader import read_json
from meshrun.parallel.expert_shards import global_state, local_state
from meshrun.versions import installed_versions

DATA_CARD = "data"  # the training data's meta.json and tokenizer.json (no tokens): how to decode
FULL_BELOW = 1 << 20  # free bytes under which a save that failed is taken to have filled the disk
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# -- state ---------------------------------------------------------------------------------------


def model_state(parts: Sequence[nn.Module], *, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Model-wide names -> tensors for this rank's parts (wrappers stripped by DCP's helpers);
    `keep`: only the names it accepts (a LoRA run's adapters)."""
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        own = cast(dict[str, torch.Tensor], get_model_state_dict(part))  # a model state holds tensors only
        own = global_state(part, own)  # split experts (parallel.ep) saved as parts of their whole tensors
        state.update({k: v for k, v in own.items() if keep is None or keep(k)})
    return state


def optimizer_state(parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """Flattened per-parameter optimizer tensors (`state.<param>.<exp_avg|exp_avg_sq|step>`).

    Hyper-parameters (param_groups) are left out: they come from the config and the step.
    """
    state: dict[str, torch.Tensor] = {}
    for part, optimizer in zip(parts, optimizers):
        flat = global_state(part, get_optimizer_state_dict(part, optimizer, options=_OPTIM_OPTIONS))
        state.update(
            {k: cast(torch.Tensor, v) for k, v in flat.items() if k.startswith("state.")}
        )  # flattened: tensors
    return state


def load_optimizer_state(parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], loaded: dict) -> None:
    for part, optimizer in zip(parts, optimizers):
        flat = get_optimizer_state_dict(part, optimizer, options=_OPTIM_OPTIONS)
        flat.update(local_state({k: loaded[k] for k in flat if k in loaded}))
        set_optimizer_state_dict(part, optimizer, flat, options=_OPTIM_OPTIONS)


def load_model_state(parts: Sequence[nn.Module], loaded: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """`loaded` into this rank's parts; not `strict`: the tensors it lacks keep their values (a
    LoRA run's frozen base, read from its folder)."""
    for part in parts:
        own = get_model_state_dict(part)
        set_model_state_dict(
            part,
            local_state({k: loaded[k] for k in own if strict or k in loaded}),
            options=StateDictOptions(strict=strict),
        )


# -- files ---------------------------------------------------------------------------------------


def save(
    state: dict[str, torch.Tensor],
    run_dir: str | Path,
    step: int,
    *,
    keep: int,
    config: dict,
    protected: tuple[Path, ...] = (),
    data_card: tuple[Path, ...] = (),
    base: dict[str, str] | None = None,
) -> Path:
    """Collective: every rank calls it with its own tensors. Returns the final folder.

    `data_card`: the training data's meta.json and tokenizer.json, copied into `data/` so that
    `meshrun sample` decodes with the right tokenizer wherever the checkpoint goes. `base`: the
    frozen base an adapter-only checkpoint goes with (models.lora.base_identity), in the manifest.

    `protected`: checkpoints newer than the one this run resumed from (ones that failed to load,
    or later ones when an older one was named): retention never deletes them, and one this save
    would replace is moved aside instead.
    """
    tmp = start_folder(run_dir, step)
    try:
        dcp.save(state, storage_writer=shard_writer(tmp))
    except (OSError, RuntimeError, dcp.CheckpointException) as exc:  # DCP's: every rank's errors, on every rank
        raise failed_save(exc, tmp) from None
    _barrier()  # every rank's shards are on disk before anyone hashes them
    sums = _gather(shard_sums(tmp))
    return publish(tmp, sums, keep=keep, config=config, protected=protected, data_card=data_card, base=base)


def start_folder(run_dir: str | Path, step: int) -> Path:
    """Collective: the empty `.tmp` folder a save of `step` writes into (one left by a killed save
    is cleared first)."""
    tmp = checkpoint_root(run_dir) / f"step-{step:08d}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a save that was killed
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def shard_writer(tmp: Path) -> dcp.FileSystemWriter:
    """DCP's writer for this rank's shards, each file flushed to disk before the save returns."""
    return dcp.FileSystemWriter(tmp, sync_files=True)


def failed_save(exc: BaseException, tmp: Path) -> BaseException:
    """Collective after a DCP save raised `exc` on every rank: the partial save goes (its space
    back; earlier checkpoints stay as they were). Returns the error to raise: one line for a full
    disk, KeyboardInterrupt for a Ctrl-C that DCP caught mid-save (one process, where SIGINT is
    Python's: the run was interrupted, it did not fail), else `exc`."""
    interrupted = isinstance(exc, dcp.CheckpointException) and any(
        isinstance(failure, KeyboardInterrupt) for failure, _ in exc.failures.values()
    )
    full = None if interrupted else _full_disk(exc, tmp)  # before the partial save goes: the disk is still full
    if isinstance(exc, dcp.CheckpointException):
        _barrier()  # DCP's collectives worked: every rank has looked
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return KeyboardInterrupt() if interrupted else full if full is not None else exc


def shard_sums(tmp: Path) -> dict[str, int]:
    """crc32 of each shard file this rank wrote into `tmp`."""
    return {p.name: _crc32(p) for p in tmp.glob(f"__{_rank()}_*")}


def publish(
    tmp: Path,
    sums: list[dict[str, int]],
    *,
    keep: int,
    config: dict,
    protected: tuple[Path, ...] = (),
    data_card: tuple[Path, ...] = (),
    base: dict[str, str] | None = None,
) -> Path:
    """Collective, once every rank's shards in `tmp` are written and hashed (`sums`, by rank):
    rank 0 writes the manifest, renames `tmp` to its final name, moves `latest` and applies
    retention. Returns the final folder."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if _rank() == 0:
        try:
            _write_manifest(tmp, step_of(final), sums, config=config, data_card=data_card, base=base)
        except RunError:  # a full disk: the partial save goes (its space back), earlier ones stay
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final in protected:
            _move_aside(final)
        elif final.exists():
            shutil.rmtree(final)
        publish_folder(tmp, final)
        write_atomic(final.parent / LATEST, final.name + "\n")
        for old in [p for p in complete_checkpoints(final.parent.parent) if p not in protected][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _write_manifest(
    tmp: Path,
    step: int,
    sums: list[dict[str, int]],
    *,
    config: dict,
    data_card: tuple[Path, ...],
    base: dict[str, str] | None,
) -> None:
    """Rank 0, after every rank's shards: config.json, the data card, then the manifest (last: it
    marks the save complete) of every file's size and crc32."""
    write_atomic(tmp / CONFIG, json.dumps(config, indent=2))
    card = [f"{DATA_CARD}/{source.name}" for source in data_card]
    if card:
        (tmp / DATA_CARD).mkdir()
    for source, name in zip(data_card, card, strict=True):
        with atomic_target(tmp / name) as target:
            shutil.copyfile(source, target)
    files = {name: {"bytes": (tmp / name).stat().st_size, "crc32": crc} for part in sums for name, crc in part.items()}
    files.update(
        {
            name: {"bytes": (tmp / name).stat().st_size, "crc32": _crc32(tmp / name)}
            for name in (".metadata", CONFIG, *card)
        }
    )
    manifest = {"step": step, "files": files, "versions": installed_versions()}
    if base is not None:
        manifest["base"] = base
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def _full_disk(exc: BaseException, folder: Path) -> RunError | None:
    """The one-line error for a full disk (or quota) found anywhere in `exc` (its causes, or the
    per-rank failures a CheckpointException carries), or for any failed save on a disk with
    (almost) no space left: torch.save's zip writer reports a short write as 'unexpected pos', no
    errno. None for any other error."""
    seen: list[BaseException] = [exc]
    for err in seen:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return cast(RunError, disk_error(err, Path(err.filename) if err.filename else folder))
        if isinstance(err, dcp.CheckpointException):
            seen += [failure for failure, _ in err.failures.values()]
        seen += [e for e in (err.__cause__, err.__context__) if e is not None and e not in seen]
    if shutil.disk_usage(folder.parent).free < FULL_BELOW:
        return cast(RunError, disk_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), folder))
    return None


def verify(path: Path) -> None:
    """Check every file against the manifest written at save time; the error names the file."""
    manifest = read_manifest(path)
    for name, expected in manifest["files"].items():
        file, parts = path / name, Path(name).parts
        named = parts[-1:] not in ((), (".",), ("..",))
        inside = named and (len(parts) == 1 or (len(parts) == 2 and parts[0] == DATA_CARD))  # NAME or data/NAME
        if not inside or file.is_symlink() or file.parent.is_symlink():
            raise CheckpointError(
                f"checkpoint {path}: {MANIFEST} names {name!r}, which is not a file inside the folder"
            )
        if not file.is_file():
            raise DamagedCheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise DamagedCheckpointError(
                f"checkpoint file {file} is truncated or changed ({size} of {expected['bytes']} bytes)"
            )
        if _crc32(file) != expected["crc32"]:
            raise DamagedCheckpointError(f"checkpoint file {file} is corrupt (checksum mismatch)")
    metadata = SafeReader(path).read_metadata()  # refuses anything but DCP's own classes
    stray = {str(info.relative_path) for info in metadata.storage_data.values()} - manifest["files"].keys()
    if stray:
        raise CheckpointError(
            f"checkpoint index {path / '.metadata'} names files its {MANIFEST} does not list: {min(stray)!r}"
        )


def read_manifest(path: Path) -> dict:
    """The manifest of a checkpoint folder: {"step", "files": {name: {bytes, crc32}}, "versions"}."""
    try:
        manifest = read_json(path / MANIFEST)
        if not all(isinstance(v, dict) and {"bytes", "crc32"} <= v.keys() for v in manifest["files"].values()):
            raise ValueError("malformed file entries")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path} has no readable {MANIFEST} ({exc}); it is incomplete") from None
    return manifest


def load(state: dict[str, torch.Tensor], path: str | Path) -> dict[str, torch.Tensor]:
    """Fill `state` (tensors this rank needs, any layout) from the checkpoint at `path`.

    Rank 0 verifies the files first and every rank gets its verdict, so all ranks fail
    (or fall back) together.
    """
    path = Path(path)
    problem: list[tuple[bool, str] | None] = [None]  # (damaged, message)
    if _rank() == 0:
        try:
            verify(path)
        except CheckpointError as exc:
            problem[0] = (isinstance(exc, DamagedCheckpointError), str(exc))
    if dist.is_initialized():
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        damaged, message = problem[0]
        raise (DamagedCheckpointError if damaged else CheckpointError)(message)
    return _read(state, path)


def _read(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Fill `state` from a verified checkpoint folder (DCP through SafeReader)."""
    try:
        with warnings.catch_warnings():  # single-process loads (export, tests) are intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(path), no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as exc:  # DCP's own derives from BaseException
        raise CheckpointError(
            f"cannot load checkpoint {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from exc
    return state


def full_model_state(
    model: nn.Module, path: str | Path, *, keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """One process, no process group: the whole model's weights from a checkpoint of any layout
    (`keep`: only the names it accepts)."""
    state = {k: v for k, v in model.state_dict().items() if keep is None or keep(k)}
    return load(state, path)


# what a training state holds besides the model's weights (TrainState.state_dict): optimizer moments,
# progress counters, RNG states, the fp16 loss scale
NOT_WEIGHTS = ("state.", "progress.", "rng.", "scaler.")


def saved_weights(path: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every model weight a checkpoint folder holds, from its index alone
    (no model is built, nothing else is read)."""
    metadata = SafeReader(path).read_metadata()
    return {
        name: (tuple(entry.size), entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and not name.startswith(NOT_WEIGHTS)
    }


def weight_groups(
    path: str | Path, names: Sequence[str], *, group_bytes: int = 1 << 30
) -> Iterator[dict[str, torch.Tensor]]:
    """The weights `names` (as `saved_weights` lists them) of a checkpoint of any layout, read in
    groups of about `group_bytes` in the order given: a model larger than this process's memory is
    read a part at a time. The folder is verified against its manifest once, before the first group."""
    verify(Path(path))
    saved = saved_weights(path)
    group: dict[str, torch.Tensor] = {}
    held = 0
    for name in names:
        shape, dtype = saved[name]
        group[name] = torch.empty(shape, dtype=dtype)
        held += group[name].nbytes
        if held >= group_bytes:
            yield _read(group, Path(path))
            group, held = {}, 0
    if group:
        yield _read(group, Path(path))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _move_aside(folder: Path) -> None:
    """Keep a protected checkpoint under another name instead of replacing it."""
    for n in range(1, 1000):
        aside = folder.with_name(f"{folder.name}.kept-{n}")
        if not aside.exists():
            os.replace(folder, aside)
            return
    raise RunError(f"cannot move {folder} aside: {folder.name}.kept-1 .. -999 exist; clean up {folder.parent}")
