"""The tiny policy model and its tokenizer, built from scratch so that tests, CI and laptops need
no downloaded weights.

- `build_tokenizer`: a word-level tokenizer for the task alphabet (digits, + = - * ,, a-z and the
  task keywords), made with the `tokenizers` library and wrapped as a transformers fast tokenizer.
  Words are split on whitespace only: every task writes its tokens space-separated ("Q 3 7 + 4 5"),
  and anything outside the alphabet becomes <unk>, visibly, rather than silently re-split. No
  special token is added on encode: a prompt builder prepends `bos_token_id` itself, and a tool
  reply encoded mid-episode never gets a stray <bos>.
- `build_model`: a random-init LlamaForCausalLM or Qwen2ForCausalLM with tied embeddings and sdpa
  attention, seeded without disturbing the caller's RNG.
- `save_tiny_model` / `prepare_initial_model`: write a standard HF directory (config.json with
  architectures, token ids and dtype; model.safetensors; tokenizer.json; generation_config.json),
  or take `model.path` as it is (`given_model_dir` checks that it is one).
  From then on the tiny model is just a model path: `load_model` / `load_tokenizer` go through
  `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`, the same code a real model takes (one
  exception, see `load_tokenizer`), and SGLang loads the directory as it is.

torch and transformers' model classes are imported inside the functions that build or load a
model. The rollout side (the generation flow and every Dask worker) needs only the tokenizer,
and importing torch with transformers' models costs each of those processes about 3 s of CPU at
start-up: on a 2-core machine, seconds before a run's first episode.

Importing the module turns transformers' progress bars off for the process: a bar for every
save and load of a tiny model would bury tandem's own progress and the workers' logs.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from configs.sections import ModelConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

PAD, BOS, EOS, UNK, EOT = "<pad>", "<bos>", "<eos>", "<unk>", "<eot>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, EOT]
"""Ids 0-4, in this order. <eot> ends a model turn in a multi-turn episode; <eos> ends the episode."""
TASK_KEYWORDS = ["Q", "CALC", "RESULT", "ANSWER", "GET", "SET", "KEY", "VALUE", "ERROR"]
TASK_VOCABULARY = (
    SPECIAL_TOKENS
    + list(string.digits)
    + ["+", "=", "-", "*", ","]
    + list(string.ascii_lowercase)
    + TASK_KEYWORDS
)
"""Every token of the tiny tokenizer; a token's id is its index here."""

_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
hf_logging.disable_progress_bar()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer of `TASK_VOCABULARY`, with bos/eos/pad/unk set."""
    vocab = {token: index for index, token in enumerate(TASK_VOCABULARY)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Special tokens are matched before the whitespace split ("5<eot>" is two tokens) and are
    # dropped by decode(skip_special_tokens=True).
    core.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A random-init causal LM shaped by `cfg`; the same seed gives the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[cfg.architecture]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,  # transformers 5.x defaults it to False for Llama
        bos_token_id=TASK_VOCABULARY.index(BOS),
        eos_token_id=TASK_VOCABULARY.index(EOS),
        pad_token_id=TASK_VOCABULARY.index(PAD),
        dtype=cfg.dtype,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, TASK_VOCABULARY.index(EOT)],
        pad_token_id=config.pad_token_id,
    )
    return model.to(getattr(torch, cfg.dtype))


def save_tiny_model(cfg: ModelConfig, out_dir: Path, seed: int) -> Path:
    """Build the tiny model and its tokenizer and save them as an HF directory; returns it."""
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = cfg.max_position_embeddings
    model = build_model(cfg, vocab_size=len(tokenizer), seed=seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def prepare_initial_model(cfg: ModelConfig, out_dir: Path, seed: int) -> Path:
    """The directory of the run's initial model: `cfg.path` if set, else a freshly built tiny one."""
    if cfg.path is None:
        return save_tiny_model(cfg, out_dir, seed)
    return given_model_dir(cfg.path)


def given_model_dir(path: str) -> Path:
    """`model.path` as a directory; FileNotFoundError naming it unless it holds an HF config.json."""
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        hub_id = not directory.exists() and path.count("/") == 1 and not path.startswith((".", "~", "/"))
        hint = f": tandem reads a local directory; download it first (`hf download {path} --local-dir DIR`) and give DIR" if hub_id else ""
        raise FileNotFoundError(f"model.path {path!r} is not an HF model directory (no config.json){hint}")
    return directory


def load_model(path: Path | str, dtype: torch.dtype | str | None = None) -> PreTrainedModel:
    """Load an HF causal LM directory (tiny or real); dtype None keeps the one in config.json.
    Weights load from safetensors only: a directory with only pytorch_model.bin (a pickle) is
    refused with an OSError rather than unpickled."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype="auto" if dtype is None else dtype, attn_implementation="sdpa", use_safetensors=True
    )


def load_trainable_model(path: Path | str, device: torch.device | str = "cpu") -> tuple[PreTrainedModel, torch.dtype]:
    """An HF directory loaded for training on `device`, and the dtype its checkpoint is stored in
    (what the engines serve, and what `publish_snapshot` writes back).

    The weights are float32 whatever the checkpoint's dtype: they are the master copy that AdamW
    updates, and its state lives in their dtype. In bfloat16 (8 significant bits) an update
    smaller than 1/256 of a weight rounds away, so a norm weight of about 1 never moves at a
    learning rate of 1e-4; in float16 AdamW's eps (1e-8) rounds to 0 and its second moment
    underflows, and the first step writes infinities. verl, OpenRLHF and slime keep float32
    parameters and optimizer state for the same reason.

    The stored dtype is the one a plain load takes (dtype "auto": config.json's, else the
    weights' own); the model is moved to `device` and then cast there, in place, a parameter at a
    time: a 7B bfloat16 checkpoint takes 14 GB of host memory on its way to a GPU, not 28."""
    model = load_model(path)
    stored = model.dtype
    return model.to(device).float(), stored


def load_reference_model(path: Path | str, device: torch.device | str, dtype: torch.dtype | None) -> PreTrainedModel:
    """A frozen copy of the HF directory on `device` in `dtype` (None: float32): the KL term's
    reference, which is only ever run forward. Under bfloat16 autocast its matmuls run in
    bfloat16 whatever its weights' dtype, as the policy's do, so a float32 copy would double its
    memory (a 4B model: 16 GB instead of 8 on the trainer's GPU) for what autocast leaves in
    float32: the policy's embeddings, norms and residual stream. Those make the KL at v0 a small
    floor above 0 rather than 0 (exactly 0 without autocast, the CPU's default)."""
    import torch

    model = load_model(path, dtype=dtype or torch.float32)
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in an HF model directory.

    A directory that declares the generic fast tokenizer class (ours does) loads its tokenizer.json
    as it is: transformers 5.x AutoTokenizer would otherwise force the class registered for the
    model type (Qwen2Tokenizer for qwen2), which rebuilds a byte-level BPE pipeline over our
    word-level vocabulary and decodes "ANSWER 8 2" as "ANSWER82". SGLang calls AutoTokenizer and
    so gets that wrong text for a tiny qwen2 model; token ids, which tandem exchanges, are right."""
    config_file = Path(path) / "tokenizer_config.json"
    declared = None
    if config_file.is_file():
        declared = json.loads(config_file.read_text()).get("tokenizer_class")
    if declared in _GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer  # imports torch: only for a real model's own tokenizer class

    return AutoTokenizer.from_pretrained(str(path))
