"""Trainer checkpoints: an exact resume (weights, AdamW state, RNGs, ledger), pickle-free."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from configs.sections import ModelConfig
from infra.manifest import ManifestError
from infra.modelfactory import build_model
from tasks.checkpoints import (
    apply_checkpoint_retention,
    checkpoint_prefix,
    checkpoint_steps,
    latest_checkpoint_step,
    load_checkpoint,
    save_checkpoint,
    set_aside_checkpoint,
)

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
VOCAB = 40


def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(TINY, VOCAB, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step on a batch drawn from the global torch RNG (so RNG state matters)."""
    input_ids = torch.randint(0, VOCAB, (4, 8))
    loss = model(input_ids, labels=input_ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_checkpoint_round_trip_resumes_exactly(store, tmp_path) -> None:
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    model, optimizer = fresh(seed=0)
    for _ in range(3):
        train_step(model, optimizer)
    ledger = ["rollouts/v00000000/gen0-000000.parquet", "rollouts/v00000001/gen0-000001.parquet"]
    assert save_checkpoint(store, 3, model, optimizer, ledger, extra={"warmup_done": True, "tokens": 96})
    saved_optimizer = copy.deepcopy(optimizer.state_dict())  # state_dict() holds live tensors

    train_step(model, optimizer)  # the original run goes on...
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_draws = (torch.rand(3), random.random(), np.random.rand())

    torch.manual_seed(123), random.seed(123), np.random.seed(123)  # ...a new process starts
    resumed, resumed_optimizer = fresh(seed=1)
    state = load_checkpoint(store, resumed, resumed_optimizer, tmp_path / "cache")
    assert (state.step, state.ledger, state.extra) == (3, ledger, {"warmup_done": True, "tokens": 96})

    loaded = resumed_optimizer.state_dict()
    assert loaded["param_groups"] == saved_optimizer["param_groups"]
    assert loaded["param_groups"][0]["betas"] == (0.8, 0.95)
    assert loaded["state"].keys() == saved_optimizer["state"].keys()
    for index, tensors in saved_optimizer["state"].items():
        for name, value in tensors.items():
            restored = loaded["state"][index][name]
            assert restored.dtype == value.dtype and torch.equal(restored, value), (index, name)
    assert float(loaded["state"][0]["step"]) == 3.0

    train_step(resumed, resumed_optimizer)  # same batch, same update as the original's 4th step
    for got, want in zip(resumed.parameters(), expected_params, strict=True):
        assert torch.equal(got, want)
    draws = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], expected_draws[0]) and draws[1:] == expected_draws[1:]


def test_checkpoint_holds_no_pickle(store, tmp_path) -> None:
    model, optimizer = fresh(seed=0)
    train_step(model, optimizer)
    save_checkpoint(store, 1, model, optimizer, ledger=[])
    names = {key.rsplit("/", 1)[-1] for key in store.list_recursive(checkpoint_prefix(1))}
    assert names == {
        "MANIFEST.json", "model.safetensors", "optimizer.safetensors", "optimizer.json",
        "rng.safetensors", "rng.json", "state.json",
    }  # fmt: skip
    for key in store.list_recursive(checkpoint_prefix(1)):
        data = store.read_bytes(key)
        assert not data.startswith(b"\x80"), f"{key} looks like a pickle"
        assert b"PK\x03\x04" not in data[:4], f"{key} looks like a torch.save zip"


def test_latest_checkpoint_ignores_uncommitted_steps(store, tmp_path, monkeypatch) -> None:
    assert latest_checkpoint_step(store) is None
    with pytest.raises(FileNotFoundError):
        load_checkpoint(store, *fresh(seed=0), tmp_path / "cache")
    model, optimizer = fresh(seed=0)
    save_checkpoint(store, 10, model, optimizer, ledger=["a"])
    save_checkpoint(store, 20, model, optimizer, ledger=["a", "b"])
    assert not save_checkpoint(store, 20, model, optimizer, ledger=["other"]), "already committed"

    def killed(key: str, data: bytes) -> bool:
        raise OSError("killed before the commit")

    monkeypatch.setattr(store, "put_if_absent", killed)
    with pytest.raises(OSError):
        save_checkpoint(store, 30, model, optimizer, ledger=["a", "b", "c"])
    monkeypatch.undo()
    assert store.list_recursive(checkpoint_prefix(30)), "files of the killed save exist"
    assert checkpoint_steps(store) == [10, 20]
    assert latest_checkpoint_step(store) == 20
    assert load_checkpoint(store, *fresh(seed=0), tmp_path / "cache").ledger == ["a", "b"]
    with pytest.raises(ManifestError):
        load_checkpoint(store, *fresh(seed=0), tmp_path / "cache", step=30)


def test_retention_deletes_what_a_cut_short_deletion_or_a_killed_save_left_but_not_a_set_aside_checkpoint(store) -> None:
    """Retention deletes a checkpoint's manifest, then its files: a trainer killed in between
    left weights and optimizer moments that nothing saw again, since they had no manifest; so did
    a save killed before its commit. A checkpoint set aside as damaged stays for a person to see."""
    model, optimizer = fresh(seed=0)
    for step in (10, 20, 30, 40):
        save_checkpoint(store, step, model, optimizer, ledger=[])
    store.delete(f"{checkpoint_prefix(10)}/MANIFEST.json")  # its deletion, cut short
    set_aside_checkpoint(store, 20, "a flipped byte")
    store.write_atomic(f"{checkpoint_prefix(50)}/model.safetensors", b"step 50, being saved")
    assert apply_checkpoint_retention(store, keep_last=2) == []
    assert not store.list_recursive(checkpoint_prefix(10))
    assert f"{checkpoint_prefix(20)}/damaged.json" in store.list_recursive(checkpoint_prefix(20))
    assert store.list_recursive(checkpoint_prefix(50)) == [f"{checkpoint_prefix(50)}/model.safetensors"]
    assert checkpoint_steps(store) == [30, 40]


def test_corrupt_optimizer_state_is_refused(store, tmp_path) -> None:
    model, optimizer = fresh(seed=0)
    train_step(model, optimizer)
    save_checkpoint(store, 1, model, optimizer, ledger=[])
    key = f"{checkpoint_prefix(1)}/optimizer.safetensors"
    data = bytearray(store.read_bytes(key))
    data[-1] ^= 0x01
    store.write_atomic(key, bytes(data))
    resumed, resumed_optimizer = fresh(seed=1)
    before = [p.detach().clone() for p in resumed.parameters()]
    with pytest.raises(ManifestError, match="optimizer.safetensors: sha256"):
        load_checkpoint(store, resumed, resumed_optimizer, tmp_path / "cache")
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), before, strict=True))


def test_a_resumed_optimizer_keeps_its_own_step_implementation(store, tmp_path) -> None:
    """A checkpoint of a multi-tensor AdamW (the trainer's before it was fused) loaded into a
    fused one: fused it stays, with the same state and the same next step."""
    model, optimizer = fresh(seed=0)
    train_step(model, optimizer)
    save_checkpoint(store, 1, model, optimizer, [])
    resumed = build_model(TINY, VOCAB, seed=1)
    fused = torch.optim.AdamW(resumed.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
    load_checkpoint(store, resumed, fused, tmp_path / "cache")
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["betas"] == (0.8, 0.95)
    torch.manual_seed(5)
    train_step(model, optimizer)
    torch.manual_seed(5)
    train_step(resumed, fused)
    for got, want in zip(resumed.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got, want)
