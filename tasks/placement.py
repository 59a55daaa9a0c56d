"""Where the trainer computes: the torch device of its weights, optimizer and passes
(`trainer_device`, from training.device), the dtype its passes run in (`autocast_dtype`, from
training.compute_dtype), and `release_gpu_memory` for a process that trained and goes on.

`auto` has to know which GPUs are free. In local mode on a GPU machine the trainer runs beside
the SGLang engines tandem launches there, engine i (counted over every generator's fleet) on GPUs
from i x engine.tp_size of those the process sees (infra/engines/sglang.py, which places them so: flags in engine.sglang_args that
widen an engine, such as --dp-size, are not counted), each holding engine.mem_fraction_static of
its GPUs' memory: `auto` takes the first GPU after theirs. In deployed mode the training flow run sees only
its worker's GPUs (one worker per GPU set, CUDA_VISIBLE_DEVICES), so `auto` takes the first. With
no GPU left over it trains on the CPU and says so, rather than share an engine's GPU and run out
of memory mid-run. An explicit `cuda:N` is taken as asked, shared or not.

Autocast, not bfloat16 weights: the weights and AdamW's state stay float32 (tasks/trainer.py,
`load_trainable_model`), and only the matrix products run in bfloat16, as verl's and slime's
mixed precision do. float16 is not offered: it needs loss scaling, bfloat16 does not.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from configs.loader import ConfigError
from configs.schema import RunConfig
from configs.sections import TrainingConfig

if TYPE_CHECKING:
    import torch


def engine_gpus_in_process(config: RunConfig) -> int:
    """GPUs that engines launched by this process take: in local mode, every generator's SGLang
    fleet's (`first_engine_of`)."""
    if config.prefect.mode == "local" and config.engine.backend == "sglang":
        return config.prefect.generators * config.generation.engines * config.engine.tp_size
    return 0


def first_engine_of(config: RunConfig, producer: str) -> int:
    """The number of generator `producer`'s first engine among those its machine runs. In local
    mode every generator's fleet runs in one process, on one machine's GPUs: gen1's engines come
    after gen0's. A deployed generation run has its worker's GPUs to itself, so its engines
    start at 0."""
    if config.prefect.mode != "local":
        return 0
    return int(producer.removeprefix("gen")) * config.generation.engines


def trainer_device(config: RunConfig) -> torch.device:
    """training.device as a torch device; ConfigError naming the field for a GPU not here."""
    import torch

    wanted = config.training.device
    if wanted == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted == "auto":
        taken = engine_gpus_in_process(config)
        if taken < count:
            return torch.device("cuda", taken)
        if count:
            print(f"training.device auto: the engines take all {count} GPUs this process sees (prefect.generators "
                  f"x generation.engines x engine.tp_size = {taken}), so the trainer runs on the CPU; set training.device: cuda:N to "
                  "share GPU N with an engine, and lower engine.mem_fraction_static to leave it room")  # fmt: skip
        return torch.device("cpu")
    index = int(wanted.partition(":")[2] or 0)
    if index >= count:
        seen = f"{count} CUDA device(s)" if count else f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda})"
        raise ConfigError(f"training.device: {wanted!r} asks for GPU {index}, and torch sees {seen} here; use auto or cpu")
    return torch.device("cuda", index)


def autocast_dtype(training: TrainingConfig, device: torch.device) -> torch.dtype | None:
    """The dtype the trainer's passes autocast to on `device`; None: plain float32."""
    import torch

    if training.compute_dtype == "float32":
        return None
    on_gpu = device.type == "cuda"
    if on_gpu:
        with torch.cuda.device(device):  # the check asks the current device: a machine may mix GPUs
            native = torch.cuda.is_bf16_supported(including_emulation=False)
    if training.compute_dtype == "auto":
        return torch.bfloat16 if on_gpu and native else None
    if on_gpu and not native:
        raise ConfigError(f"training.compute_dtype: {torch.cuda.get_device_name(device)} has no bfloat16; use float32 or auto")
    return torch.bfloat16


def release_gpu_memory(device: torch.device) -> None:
    """Give back the GPU memory of a model that is gone (the warm-start's): its process goes on,
    as the pipeline (deployed mode: on a `training` worker, beside its trainer), and torch's
    caching allocator would keep the weights', gradients' and optimizer's memory for the whole
    run. The CUDA context itself (a few hundred MB) stays with the process."""
    if device.type == "cuda":
        import torch

        gc.collect()  # the model and its optimizers may sit in reference cycles
        torch.cuda.empty_cache()
