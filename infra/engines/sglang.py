"""Launch real SGLang servers for `backend: sglang` (GPU machines; `pip install 'tandem[sglang]'`).

Why only a launcher: SGLang serves the same native HTTP API as tandem's CPU engine (api.py is
the shared contract), so the rollout client is the same code for both backends. This module builds
the `python -m sglang.launch_server` command and runs it as an `EngineProcess` (own session, wait
for /health, SIGTERM to its own process group, stopped by infra/engines/guard.py if the process
that started it dies). It imports nothing of SGLang and loads without it;
tests/test_sglang_compat.py checks every flag it passes against SGLang's recorded CLI.

The API key stays off the command line, where `ps` shows it to every local user: it goes in a 0600
YAML file passed with `--config` (SGLang reads it once at start; it is deleted once the server
answers). SGLang 0.5.23 prints its resolved arguments, key included, in its startup log, so the log
is created 0600 and the log tails we put in errors have the key masked.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from configs.sections import EngineConfig
from infra.engines.process import EngineProcess, EngineStartError, connect_host

log = logging.getLogger(__name__)
MASK = "***"
SGLANG_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}
"""Pinned for every SGLang server, whatever the user's environment says: behaviour logprobs of the
distribution the engine samples from, log softmax(logits / T) (SGLang's default), which is what
the trainer computes (tasks/trainer.py divides its logits by generation.temperature). With the
variable set, SGLang reports the T = 1 distribution's, and at any other temperature every token's
importance ratio would be off."""
INSTALL_HINT = "pip install 'tandem[sglang]'"
FLOAT32_ATTENTION_BACKEND = "triton"
"""The attention backend a float32 checkpoint (the tiny factory model's) is served with, unless
engine.sglang_args gives --attention-backend (--prefill- or --decode-attention-backend there set
one phase's, over this). SGLang 0.5.23 picks FlashAttention 3 on Hopper GPUs by default
(`get_default_attn_backend`), and FlashAttention runs fp16 and bf16 only; Triton's kernels, which
SGLang falls back to where a model needs it, take float32."""


def sglang_server_args(
    engine: EngineConfig, model_path: str, port: int, weight_version: str | None, seed: int,
    *, dtype: str | None = None, config_file: Path | None = None, base_gpu_id: int = 0, nccl_port: int | None = None,
) -> list[str]:  # fmt: skip
    """The command line of one SGLang server. With an API key, it travels in `config_file` (a
    YAML file the caller writes with `write_secret_config`), or as `--api-key` when that is None.
    `dtype` should be given: SGLang's "auto" runs float32 checkpoints in float16. The server runs
    on GPUs base_gpu_id .. base_gpu_id + tp_size - 1: engine i of a fleet on its own ones.

    `nccl_port`: the port of its torch.distributed store, bound at launch (with tp_size 1 too).
    Left to SGLang, it is drawn from 22000-29999, where tandem picks the engines' HTTP ports,
    which SGLang binds only once the model has loaded, minutes later: one engine's store could
    take a sibling's HTTP port, and that engine then failed its start."""
    args = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path), "--host", engine.host, "--port", str(port),
        "--tp-size", str(engine.tp_size), "--mem-fraction-static", str(engine.mem_fraction_static),
        "--random-seed", str(seed), "--base-gpu-id", str(base_gpu_id),
    ]  # fmt: skip
    if nccl_port is not None:
        args += ["--nccl-port", str(nccl_port)]
    if weight_version is not None:
        args += ["--weight-version", weight_version]
    if dtype is not None:
        args += ["--dtype", dtype]
    if dtype == "float32" and not any(arg.split("=", 1)[0] == "--attention-backend" for arg in engine.sglang_args):
        args += ["--attention-backend", FLOAT32_ATTENTION_BACKEND]  # a phase's own backend flag still overrides it
    if engine.api_key is not None:
        key = engine.api_key.get_secret_value()
        args += ["--config", str(config_file)] if config_file is not None else ["--api-key", key]
    return args + list(engine.sglang_args)


def secret_config(engine: EngineConfig) -> dict[str, str]:
    """The `--config` YAML content that carries the API key (keys are SGLang flag names)."""
    return {"api-key": engine.api_key.get_secret_value()} if engine.api_key is not None else {}


def write_secret_config(path: Path, engine: EngineConfig) -> None:
    """Write `secret_config` readable by this user only (a fresh file, created 0600)."""
    text = "".join(f"{key}: {json.dumps(value)}\n" for key, value in secret_config(engine).items())
    path.unlink(missing_ok=True)  # O_EXCL below: never reuse a file (or link) someone else made
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text)


def masked(args: list[str]) -> list[str]:
    """`args` with the value after `--api-key` replaced by MASK: what may be logged."""
    return [MASK if i and args[i - 1] == "--api-key" else arg for i, arg in enumerate(args)]


def checkpoint_dtype(model_path: str | Path) -> str | None:
    """The dtype an HF directory's config.json declares (`dtype`, or the older `torch_dtype`)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else None


def sglang_engine_process(
    engine: EngineConfig, model_path: str, port: int, log_path: Path,
    weight_version: str | None = None, seed: int = 0, dtype: str | None = None, index: int = 0, nccl_port: int | None = None,
) -> SGLangEngineProcess:  # fmt: skip
    """SGLang server `index` of a fleet for `model_path`: on its own GPUs (tp_size of them from
    index x tp_size) with its own seed, in the checkpoint's own dtype unless `dtype` is given
    (so behaviour logprobs come from the precision the trainer uses, not SGLang's float16)."""
    dtype = dtype or checkpoint_dtype(model_path)
    return SGLangEngineProcess(
        engine, model_path, port, log_path, weight_version, seed + index, dtype, index * engine.tp_size, nccl_port
    )  # fmt: skip


def require_sglang() -> None:
    """EngineStartError with the install command unless SGLang is importable here (`tandem run`
    and `tandem eval` ask before they start anything; each engine start asks again)."""
    if importlib.util.find_spec("sglang") is None:
        raise EngineStartError(f"engine.backend 'sglang' needs SGLang installed: {INSTALL_HINT}")


class SGLangEngineProcess(EngineProcess):
    """One `sglang.launch_server` process; `url` is where clients reach it."""

    def __init__(
        self, engine: EngineConfig, model_path: str, port: int, log_path: Path,
        weight_version: str | None = None, seed: int = 0, dtype: str | None = None, base_gpu_id: int = 0,
        nccl_port: int | None = None,
    ):  # fmt: skip
        self._secret = engine.api_key.get_secret_value() if engine.api_key is not None else None
        self._engine = engine
        self.config_file = log_path.with_name(f".{log_path.stem}.secret.yaml") if self._secret else None
        command = sglang_server_args(
            engine, model_path, port, weight_version, seed, dtype=dtype, config_file=self.config_file, base_gpu_id=base_gpu_id,
            nccl_port=nccl_port,
        )  # fmt: skip
        super().__init__(command, f"http://{connect_host(engine.host)}:{port}", log_path, env=SGLANG_ENV, guard=True)

    start_timeout = 900.0
    """A first start loads the model, compiles kernels and captures CUDA graphs: minutes."""

    def launch(self) -> SGLangEngineProcess:
        """Start SGLang without waiting for it (a fleet launches every engine, then waits for
        each): its log private to this user and the key's config file written first, here and
        not in `start`, which a fleet does not call."""
        require_sglang()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        os.chmod(self.log_path, 0o600)
        if self.config_file is not None:
            write_secret_config(self.config_file, self._engine)
        log.info("starting SGLang at %s: %s", self.url, shlex.join(masked(self.command)))
        try:
            return super().launch()
        except BaseException:
            self._remove_secret_config()
            raise

    def wait_healthy(self, timeout: float | None = None) -> SGLangEngineProcess:
        """Wait for /health, then remove the key's config file: SGLang has read it once it
        answers, and so has a server that failed (its errors quote log_tail(), which masks the key)."""
        try:
            return super().wait_healthy(timeout)
        finally:
            self._remove_secret_config()

    def stop(self, grace: float = 20.0) -> None:
        """Stop it, and remove the key's config file if a start that failed elsewhere (another
        engine of its fleet) left it there."""
        try:
            super().stop(grace)
        finally:
            self._remove_secret_config()

    def _remove_secret_config(self) -> None:
        if self.config_file is not None:
            self.config_file.unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        return self._mask(super().log_tail(lines))

    def _mask(self, text: str) -> str:
        return text.replace(self._secret, MASK) if self._secret else text

    def __repr__(self) -> str:
        return f"SGLangEngineProcess(url={self.url!r}, pid={self.pid}, command={shlex.join(masked(self.command))!r})"
