"""The supervised warm-start: a few steps on the environment's own demonstrations before RL.

A tiny random-init model gets zero reward from pure RL on multi-token exact-match tasks: with no
reward there is no gradient. So a run starts with `training.warmup_steps` supervised steps on
demonstrations (loss on model tokens only), stopped early on purpose, at a low score, so that RL
visibly does the rest. The warm-started model is what gets published as v0.
"""

from __future__ import annotations

import random

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from configs.schema import RunConfig
from tasks.envs import Environment, environment_factory
from tasks.rollout import prompt_token_ids
from tasks.trainer import Trainer, build_supervised_batch

WARMUP_BATCH = 64


def demonstration_example(env: Environment, prompt, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[bool]]:
    """Token ids of a perfect episode and, per token, whether the model produced it."""
    ids = prompt_token_ids(tokenizer, env.reset(prompt))
    flags = [False] * len(ids)
    for segment in env.demonstration(prompt):
        tokens = tokenizer.encode(segment.text, add_special_tokens=False)
        ids += tokens
        flags += [segment.from_model] * len(tokens)
    return ids, flags


def warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig) -> list[float]:
    """Run the warm-start on `model` in place; returns the loss of every step."""
    make_env = environment_factory(config.env.entrypoint, config.env.max_turns, config.env.kwargs)
    prompts = make_env().prompts("train", config.env.train_prompts, config.seed)
    rng = random.Random(config.seed)
    trainer = Trainer(model, config.training.model_copy(update={"kl_coef": 0.0}))  # supervised: no KL term
    losses = []
    for _ in range(config.training.warmup_steps):
        batch = [demonstration_example(make_env(), rng.choice(prompts), tokenizer) for _ in range(WARMUP_BATCH)]
        losses.append(trainer.supervised_step(*build_supervised_batch(batch))["loss"])
    model.eval()
    return losses
