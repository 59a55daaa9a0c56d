"""Where the trainer computes: training.device resolved against the GPUs this process sees and
the engines it launches, and training.compute_dtype's autocast with float32 weights.

This machine has no GPU. The choice of GPU is tested with torch's CUDA queries answering for a
machine that has some (nothing is placed on those GPUs); the autocast is tested on the CPU, where
torch autocasts to bfloat16 too."""

from __future__ import annotations

import copy

import pytest
import torch

from configs.loader import ConfigError
from configs.schema import RunConfig
from configs.sections import TrainingConfig
from infra.engines.fleet import EngineFleet
from infra.modelfactory import load_model, load_tokenizer, load_trainable_model, save_tiny_model
from tasks.checkpoints import load_checkpoint, save_checkpoint
from tasks.placement import autocast_dtype, engine_gpus_in_process, first_engine_of, trainer_device
from tasks.snapshots import load_snapshot, publish_snapshot
from tasks.trainer import Trainer, build_supervised_batch
from tests.test_trainer import TINY, on_policy_batch, tiny_model

CPU = torch.device("cpu")


def run_config(
    device: str = "auto", mode: str = "local", backend: str = "sglang", engines: int = 2, tp_size: int = 1, generators: int = 1,
) -> RunConfig:  # fmt: skip
    return RunConfig.model_validate({
        "training": {"device": device}, "prefect": {"mode": mode, "generators": generators},
        "generation": {"engines": engines}, "engine": {"backend": backend, "tp_size": tp_size},
    })  # fmt: skip


@pytest.fixture
def gpus(monkeypatch):
    """Make torch report `n` CUDA devices (queries only: nothing may be put on them)."""

    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return visible


def test_engines_take_gpus_only_where_this_process_launches_sglang():
    assert engine_gpus_in_process(run_config(engines=2, tp_size=2)) == 4
    assert engine_gpus_in_process(run_config(mode="deployed")) == 0  # the generation runs' own workers
    assert engine_gpus_in_process(run_config(backend="cpu")) == 0
    assert engine_gpus_in_process(run_config(backend="sim")) == 0


def test_local_generators_place_their_engines_one_after_another(tmp_path):
    """In local mode every generator's fleet runs on this machine: gen1's engines after gen0's
    (each on GPU 0 would take mem_fraction_static of it twice), the trainer after them all."""
    config = run_config(engines=2, tp_size=2, generators=2)
    assert engine_gpus_in_process(config) == 8
    assert [first_engine_of(config, p) for p in ("gen0", "gen1")] == [0, 2]
    assert first_engine_of(run_config(mode="deployed", engines=2, generators=2), "gen1") == 0, "its worker's GPUs"
    fleet = EngineFleet(config.engine, 2, tmp_path, 0, tmp_path, first_engine=first_engine_of(config, "gen1"))
    assert [dict(zip(p.command, p.command[1:]))["--base-gpu-id"] for p in fleet.processes] == ["4", "6"]


def test_auto_takes_the_first_gpu_after_the_engines(gpus, capsys):
    gpus(4)
    assert trainer_device(run_config(engines=2, tp_size=1)) == torch.device("cuda", 2)
    assert trainer_device(run_config(engines=1, tp_size=2)) == torch.device("cuda", 2)
    assert trainer_device(run_config(engines=1, generators=3)) == torch.device("cuda", 3)
    assert trainer_device(run_config(mode="deployed", engines=4)) == torch.device("cuda", 0)
    assert trainer_device(run_config(backend="cpu")) == torch.device("cuda", 0)
    assert capsys.readouterr().out == ""


def test_auto_trains_on_the_cpu_and_says_why_when_the_engines_take_every_gpu(gpus, capsys):
    gpus(2)
    assert trainer_device(run_config(engines=2)) == CPU
    said = capsys.readouterr().out
    assert "the engines take all 2 GPUs" in said and "training.device: cuda:N" in said
    gpus(0)
    assert trainer_device(run_config()) == CPU
    assert capsys.readouterr().out == "", "a machine without a GPU is no news"


def test_a_named_gpu_is_taken_as_asked_or_refused_naming_the_field(gpus):
    gpus(2)
    assert trainer_device(run_config("cuda", engines=2)) == torch.device("cuda", 0)  # shared with engine 0, as asked
    assert trainer_device(run_config("cuda:1")) == torch.device("cuda", 1)
    assert trainer_device(run_config("cpu")) == CPU
    with pytest.raises(ConfigError, match=r"training.device: 'cuda:2' asks for GPU 2, and torch sees 2 CUDA device\(s\)"):
        trainer_device(run_config("cuda:2"))
    gpus(0)
    with pytest.raises(ConfigError, match="training.device: 'cuda' asks for GPU 0, and torch sees no CUDA device"):
        trainer_device(run_config("cuda"))


def test_compute_dtype_autocasts_to_bfloat16_only_where_asked_or_on_a_gpu():
    assert autocast_dtype(TrainingConfig(), CPU) is None
    assert autocast_dtype(TrainingConfig(compute_dtype="float32"), CPU) is None
    assert autocast_dtype(TrainingConfig(compute_dtype="bfloat16"), CPU) == torch.bfloat16


def dtypes_of_the_linear_outputs(trainer: Trainer) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda module, args, output: seen.add(output.dtype))
    return seen


def test_a_bfloat16_step_computes_in_bfloat16_and_keeps_float32_weights_and_state():
    """The control is the float32 trainer: same model, same batch, every matrix product in
    float32. The bfloat16 one's products run in bfloat16, its loss and ratios stay within
    bfloat16's rounding of the float32 ones, and what AdamW updates stays float32."""
    model = tiny_model()
    batch = on_policy_batch(model, [1.0, -1.0])
    steps, seen = {}, {}
    for dtype in ("float32", "bfloat16"):
        trainer = Trainer(copy.deepcopy(model), TrainingConfig(lr=1e-3, compute_dtype=dtype))
        seen[dtype] = dtypes_of_the_linear_outputs(trainer)
        steps[dtype] = trainer.rl_step(batch)
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        assert all(s.dtype == torch.float32 for state in trainer.optimizer.state.values() for k, s in state.items() if k != "step")
    assert seen == {"float32": {torch.float32}, "bfloat16": {torch.bfloat16}}
    assert steps["bfloat16"]["ratio_mean"] != steps["float32"]["ratio_mean"], "bfloat16 rounds: the passes differ"
    assert steps["bfloat16"]["ratio_mean"] == pytest.approx(1.0, abs=0.05)
    assert steps["bfloat16"]["loss"] == pytest.approx(steps["float32"]["loss"], abs=0.05)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: scripts/gpu_check.sh")),
])  # fmt: skip
def test_a_trainer_on_its_device_publishes_and_checkpoints_what_the_cpu_and_it_read_back(device, file_store, tmp_path):
    """The trainer's whole cycle where training.device puts it: a bfloat16 checkpoint loaded
    there as float32 masters, a warm-start step and an RL step with the KL term in bfloat16, the
    snapshot written back in bfloat16 and the checkpoint, read back on the CPU as they were after
    the step, and resumed on the device, where training goes on. scripts/gpu_check.sh runs the
    cuda case."""
    path = save_tiny_model(TINY.model_copy(update={"dtype": "bfloat16"}), tmp_path / "m", seed=0)
    model, stored = load_trainable_model(path, device)
    assert model.device.type == device and model.dtype == torch.float32
    config = TrainingConfig(lr=1e-3, compute_dtype="bfloat16", kl_coef=0.1)
    trainer = Trainer(model, config, ref_model=load_trainable_model(path, device)[0])
    warm = trainer.supervised_step(*build_supervised_batch([([1, 5, 6, 7], [0, 0, 1, 1]), ([1, 8, 9], [0, 1, 1])]))
    metrics = trainer.rl_step(on_policy_batch(load_model(path).float(), [1.0, -1.0]))
    assert warm["loss"] > 0 and metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0 and metrics["kl"] > 0
    trained = {name: p.detach().cpu() for name, p in model.named_parameters()}

    publish_snapshot(file_store, model, load_tokenizer(path), 1, dtype=stored)
    served = load_model(load_snapshot(file_store, tmp_path / "weights", 1))
    assert served.dtype == torch.bfloat16
    for name, weight in served.named_parameters():
        assert torch.equal(weight, trained[name].to(torch.bfloat16)), name

    assert save_checkpoint(file_store, 1, model, trainer.optimizer, [])
    for where in ("cpu", device):
        resumed = load_trainable_model(path, where)[0]
        again = Trainer(resumed, config, ref_model=load_trainable_model(path, where)[0], version=1)
        load_checkpoint(file_store, resumed, again.optimizer, tmp_path / f"checkpoints-{where}")
        for name, weight in resumed.named_parameters():
            assert torch.equal(weight.cpu(), trained[name]), (where, name)
        moments = [s["exp_avg"] for s in again.optimizer.state.values()]
        assert moments and all(m.device.type == where and m.abs().sum() > 0 for m in moments)
        assert again.rl_step(on_policy_batch(load_model(path).float(), [1.0, -1.0]))["version"] == 2
