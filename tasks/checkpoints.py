"""Trainer checkpoints: everything a killed trainer needs to resume exactly where it stopped.

    checkpoints/step{K:08d}/model.safetensors      model parameters (tied weights stored once)
                            optimizer.safetensors  every tensor of optimizer.state_dict()
                            optimizer.json         the rest of it (param_groups, scalars), with
                                                   tensors as {"__tensor__": name} references
                            rng.safetensors        torch CPU (and CUDA) generator states
                            rng.json               python `random` and numpy global RNG states
                            state.json             step, ledger of consumed shard keys, extra
                            MANIFEST.json          written last: the commit (infra/manifest.py)

Why no pickle (no torch.save/torch.load): a checkpoint is read back from a bucket that other
machines write, and unpickling runs arbitrary code. safetensors and JSON are data only. The JSON
encoding keeps what JSON loses: tuples (AdamW's betas) as {"__tuple__": [...]}, non-string dict
keys (the optimizer's per-parameter state, keyed by int) as {"__items__": [[k, v], ...]}, so the
state dict round-trips exactly, `step` tensors included.

The ledger is the trainer's exactly-once record: shards consumed up to step K. Restoring it with
the weights and optimizer of step K means a resumed trainer neither skips nor repeats a shard.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from infra.manifest import MANIFEST_NAME, commit_directory, fetch_directory, numbered_directories
from infra.scratch import staging_area
from infra.storage import RunStore

CHECKPOINTS = "checkpoints"
STATE_FORMAT = "tandem-checkpoint/1"
_STEP_DIR = re.compile(r"step(\d{8})")
DAMAGED_MANIFEST_NAME = "MANIFEST.damaged.json"
"""A set-aside checkpoint's manifest (`set_aside_checkpoint`): kept, with its files, for a person to look into."""
STEP_IMPLEMENTATION = ("fused", "foreach", "capturable")
"""Optimizer options that choose how a step is computed, not what it computes: a resumed
optimizer keeps its own."""


@dataclass
class CheckpointState:
    """What `load_checkpoint` returns besides restoring model, optimizer and RNGs in place."""

    step: int
    ledger: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_prefix(step: int) -> str:
    """The key prefix of the checkpoint of `step`: checkpoints/step00000010."""
    if step < 0:
        raise ValueError(f"a step is >= 0, got {step}")
    return f"{CHECKPOINTS}/step{step:08d}"


def save_checkpoint(
    store: RunStore,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ledger: Iterable[str],
    extra: dict[str, Any] | None = None,
    staging_dir: Path | None = None,
) -> bool:
    """Write and commit the checkpoint of `step`; False if that step was already committed."""
    with staging_area("checkpoint-", staging_dir or store.staging_dir()) as out:
        save_model(model, str(out / "model.safetensors"))
        tensors: dict[str, torch.Tensor] = {}
        optimizer_json = _encode(optimizer.state_dict(), tensors, "optimizer")
        save_file(tensors, str(out / "optimizer.safetensors"))
        _write_json(out / "optimizer.json", optimizer_json)
        save_file(_torch_rng_states(), str(out / "rng.safetensors"))
        _write_json(out / "rng.json", _host_rng_states())
        state = {"format": STATE_FORMAT, "step": step, "ledger": list(ledger), "extra": extra or {}}
        _write_json(out / "state.json", state)
        return commit_directory(store, out, checkpoint_prefix(step), extra={"step": step}, take_files=True)


def checkpoint_steps(store: RunStore) -> list[int]:
    """Steps that have a committed checkpoint, ascending."""
    return _step_dirs(store)[0]


def _step_dirs(store: RunStore) -> tuple[list[int], list[int]]:
    """From one listing: the committed checkpoints' steps, and the steps whose directory holds
    files but neither a manifest nor a damaged one's (`set_aside_checkpoint`), both ascending."""
    files = numbered_directories(store, CHECKPOINTS, _STEP_DIR)
    committed = sorted(step for step, names in files.items() if MANIFEST_NAME in names)
    uncommitted = sorted(step for step, names in files.items() if not names & {MANIFEST_NAME, DAMAGED_MANIFEST_NAME})
    return committed, uncommitted


def latest_checkpoint_step(store: RunStore) -> int | None:
    """The newest committed checkpoint's step, or None if there is none."""
    steps = checkpoint_steps(store)
    return steps[-1] if steps else None


def load_checkpoint(
    store: RunStore,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cache_dir: Path,
    step: int | None = None,
) -> CheckpointState:
    """Fetch and verify a checkpoint (default: the newest), restore model, optimizer and RNGs in
    place, and return its step, ledger and extra state."""
    if step is None:
        step = latest_checkpoint_step(store)
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {store.url_of(CHECKPOINTS)}")
    local = Path(cache_dir) / f"step{step:08d}"
    fetch_directory(store, checkpoint_prefix(step), local)
    state = json.loads((local / "state.json").read_text())
    if state.get("format") != STATE_FORMAT or state.get("step") != step:
        raise ValueError(f"{local}/state.json is not the {STATE_FORMAT} state of step {step}")
    optimizer_state = _decode(
        json.loads((local / "optimizer.json").read_text()), load_file(local / "optimizer.safetensors")
    )
    load_model(model, local / "model.safetensors", strict=True)
    # How the step is computed stays the optimizer's own: a checkpoint from before the trainer's
    # AdamW was fused would turn it back to the multi-tensor path, and its temporaries, for good.
    optimizer_state["param_groups"] = [saved | {k: group[k] for k in STEP_IMPLEMENTATION if k in group}
                                       for saved, group in zip(optimizer_state["param_groups"], optimizer.param_groups)]  # fmt: skip
    optimizer.load_state_dict(optimizer_state)
    _restore_rng(load_file(local / "rng.safetensors"), json.loads((local / "rng.json").read_text()))
    return CheckpointState(step=step, ledger=list(state["ledger"]), extra=dict(state["extra"]))


def apply_checkpoint_retention(store: RunStore, keep_last: int) -> list[int]:
    """Delete every committed checkpoint but the newest `keep_last`; returns the steps deleted.

    A checkpoint holds the weights and both of AdamW's moments in float32, 12 bytes a
    parameter: kept for good, a 7B model's every tenth step of a thousand would fill 8 TB. Its
    manifest goes first, so that no reader takes a checkpoint half deleted for committed. The
    files of a deletion cut short after it (a killed trainer, an outage) are deleted at the next
    retention, as are those of a save killed before its commit, once a later step is committed."""
    if keep_last < 2:
        raise ValueError(f"keep_last must be >= 2 (a damaged newest checkpoint falls back to the one before), got {keep_last}")
    committed, uncommitted = _step_dirs(store)
    deleted = committed[:-keep_last]
    for step in deleted:
        prefix = checkpoint_prefix(step)
        store.delete(f"{prefix}/{MANIFEST_NAME}")
        store.delete_prefix(prefix)
    for step in uncommitted:
        if committed and step < committed[-1]:  # a save in progress is of a later step
            store.delete_prefix(checkpoint_prefix(step))
    return deleted


class CheckpointDamaged(RuntimeError):
    """The newest checkpoint failed verification; it has been set aside (`set_aside_checkpoint`)."""


def set_aside_checkpoint(store: RunStore, step: int, reason: str) -> str:
    """Uncommit the checkpoint of `step`, which failed verification: its manifest moves to
    MANIFEST.damaged.json beside the reason, so that `latest_checkpoint_step` passes it over
    and the run resumes from the one before when it starts again. Its files stay until a new
    checkpoint of that step replaces them. Returns the prefix."""
    prefix = checkpoint_prefix(step)
    manifest = store.read_bytes(f"{prefix}/{MANIFEST_NAME}")
    store.write_atomic(f"{prefix}/{DAMAGED_MANIFEST_NAME}", manifest)
    store.write_atomic(f"{prefix}/damaged.json", json.dumps({"reason": reason}).encode())
    store.delete(f"{prefix}/{MANIFEST_NAME}")
    return prefix


def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    """JSON form of `value`; each tensor goes into `tensors` under its path and is referenced."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, tensors, f"{path}.{k}") for k, v in value.items()}
        return {
            "__items__": [
                [_encode(k, tensors, f"{path}.key{i}"), _encode(v, tensors, f"{path}.{k}")]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{path}: cannot store a {type(value).__name__} in a checkpoint")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `_encode`."""
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {"__tensor__"}:
        return tensors[value["__tensor__"]]
    if value.keys() == {"__tuple__"}:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if value.keys() == {"__items__"}:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _torch_rng_states() -> dict[str, torch.Tensor]:
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            states[f"torch_cuda.{index}"] = cuda_state
    return states


def _host_rng_states() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": _encode(random.getstate(), {}, "python"),
        "numpy": {
            "bit_generator": name,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
    }


def _restore_rng(torch_states: dict[str, torch.Tensor], host_states: dict[str, Any]) -> None:
    torch.set_rng_state(torch_states["torch_cpu"])
    cuda_states = [torch_states[f"torch_cuda.{i}"] for i in range(len(torch_states) - 1)]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    random.setstate(_decode(host_states["python"], {}))
    state = host_states["numpy"]
    np.random.set_state(
        (
            state["bit_generator"],
            np.array(state["keys"], dtype=np.uint32),
            state["pos"],
            state["has_gauss"],
            state["cached_gaussian"],
        )
    )


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, separators=(",", ":")))
