"""The tiny model factory: a standard HF directory that round-trips through from_pretrained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from configs.sections import ModelConfig
from infra.modelfactory import (
    TASK_VOCABULARY,
    build_model,
    build_tokenizer,
    load_model,
    load_tokenizer,
    prepare_initial_model,
    save_tiny_model,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64}


def ids(*tokens: str) -> list[int]:
    return [TASK_VOCABULARY.index(token) for token in tokens]


def test_tokenizer_encodes_task_strings_to_known_tokens() -> None:
    tokenizer = build_tokenizer()
    assert len(tokenizer) == len(TASK_VOCABULARY) == len(set(TASK_VOCABULARY))
    encoded = tokenizer.encode("Q 3 7 + 4 5")
    assert encoded == ids("Q", "3", "7", "+", "4", "5")
    assert tokenizer.decode(encoded) == "Q 3 7 + 4 5"
    turn = tokenizer.encode("CALC 3 7 + 4 5<eot>")
    assert turn == ids("CALC", "3", "7", "+", "4", "5", "<eot>")
    assert tokenizer.decode(turn, skip_special_tokens=True) == "CALC 3 7 + 4 5"
    assert tokenizer.encode("37 banana") == ids("<unk>", "<unk>")
    special = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]
    assert special + [tokenizer.unk_token_id] == ids("<pad>", "<bos>", "<eos>", "<unk>")


@pytest.mark.parametrize(
    ("architecture", "class_name"), [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")]
)
def test_save_load_round_trip_gives_identical_logits(tmp_path, architecture, class_name) -> None:
    cfg = ModelConfig(architecture=architecture, **TINY)
    path = save_tiny_model(cfg, tmp_path / "model", seed=3)
    original = build_model(cfg, len(build_tokenizer()), seed=3).eval()
    loaded = load_model(path).eval()
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(loaded).__name__ == type(plain).__name__ == class_name
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    tokenizer = load_tokenizer(path)
    input_ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode("Q 3 7 + 4 5")]])
    with torch.no_grad():
        expected = original(input_ids).logits
        assert torch.equal(loaded(input_ids).logits, expected)
        assert torch.equal(plain(input_ids).logits, expected)
    assert tokenizer.encode("Q 3 7 + 4 5") == ids("Q", "3", "7", "+", "4", "5")
    assert tokenizer.decode(ids("ANSWER", "8", "2", "<eos>"), skip_special_tokens=True) == "ANSWER 8 2"


def test_seed_decides_the_weights() -> None:
    cfg = ModelConfig(**TINY)
    before = torch.get_rng_state()
    a, b, c = (build_model(cfg, 60, seed) for seed in (1, 1, 2))
    assert torch.equal(torch.get_rng_state(), before), "building a model must not move the global RNG"
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_saved_directory_is_a_standard_hf_model_dir(tmp_path) -> None:
    cfg = ModelConfig(architecture="qwen2", dtype="bfloat16", **TINY)
    path = save_tiny_model(cfg, tmp_path / "model", seed=0)
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"]
    assert raw["model_type"] == "qwen2"
    assert raw["dtype"] == "bfloat16"
    assert raw["vocab_size"] == len(TASK_VOCABULARY)
    assert raw["tie_word_embeddings"] is True
    token_ids = [raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]]
    assert token_ids == ids("<bos>", "<eos>", "<pad>")
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"]) == (32, 2, 4)
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ids("<eos>", "<eot>")
    names = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert AutoConfig.from_pretrained(path).vocab_size == len(load_tokenizer(path))
    assert load_model(path).dtype == torch.bfloat16
    assert load_model(path, dtype=torch.float32).dtype == torch.float32


def test_prepare_initial_model_prefers_a_given_path(tmp_path) -> None:
    built = prepare_initial_model(ModelConfig(**TINY), tmp_path / "built", seed=0)
    assert (built / "config.json").is_file()
    assert prepare_initial_model(ModelConfig(path=str(built), **TINY), tmp_path / "unused", 0) == built
    assert not (tmp_path / "unused").exists()
    with pytest.raises(FileNotFoundError, match="config.json"):
        prepare_initial_model(ModelConfig(path=str(tmp_path / "nothing")), tmp_path / "x", 0)


def test_the_rollout_side_imports_no_torch_and_shows_no_transformers_bars() -> None:
    """A Dask worker imports the generation flow; torch would cost it seconds of start-up."""
    probe = ("import sys, transformers.utils.logging as hf; import flows.generation, infra.modelfactory; "
             "print('torch' in sys.modules, hf.is_progress_bar_enabled())")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
