"""Evaluation: greedy decoding of held-out prompts against engines serving a pinned snapshot.

It runs the same rollout code as training (tasks/rollout.py) with temperature 0 and one sample
per prompt, so what is measured is exactly the agent loop that is trained, multi-turn tool calls
included. The score is the mean reward, and `solved` the fraction of episodes with reward 1.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from pathlib import Path

from configs.schema import RunConfig
from infra.engines.api import SamplingParams
from infra.engines.client import EngineClient
from infra.modelfactory import load_tokenizer
from tasks.envs import Prompt, load_environment
from tasks.rollout import model_eos_ids, run_episode


HELD_OUT_SPLIT = 2
"""Which held-out prompts the built-in environments draw: 2 since a problem is held out only if
its operands-swapped twin is too (tasks/envs/base.py `sample_prompts`); scores recorded under
another are not this one's."""


def evaluation_setup(config: RunConfig, prompts: list[Prompt] | None = None) -> str:
    """A digest of what a score depends on besides the weights: the held-out prompts themselves
    (`prompts`, default: `held_out_prompts`), the environment and how long its episodes may run.
    Each evaluation record carries it, and a recorded score is reused, or compared with another,
    only under the same setup: a `tandem eval --set env.kwargs...` of a run otherwise left a
    score that the run's next start took for its own, and that retraining compared against.

    The prompts, not only the seed and count that draw them: an environment over a data file
    that is refreshed between nights draws other held-out prompts from the same settings, and
    PROMOTED's score on the old ones was compared with a candidate's on the new."""
    env, generation = config.env, config.generation
    prompts = held_out_prompts(config) if prompts is None else prompts
    drawn = json.dumps([[p.prompt_id, p.text, p.answer] for p in prompts], default=str).encode()
    fields = {
        "seed": config.seed, "eval_prompts": env.eval_prompts, "entrypoint": env.entrypoint, "kwargs": env.kwargs,
        "max_turns": env.max_turns, "max_new_tokens": generation.max_new_tokens,
        "context_length": config.model.max_position_embeddings,
        "held_out": HELD_OUT_SPLIT, "prompts": hashlib.sha256(drawn).hexdigest(),
    }  # fmt: skip
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def held_out_prompts(config: RunConfig) -> list[Prompt]:
    """The prompts an evaluation of `config`'s run scores, as its environment draws them now."""
    env_cls = load_environment(config.env.entrypoint)
    return env_cls(max_turns=config.env.max_turns, **config.env.kwargs).prompts("eval", config.env.eval_prompts, config.seed)


def is_score(value: object) -> bool:
    """Whether a recorded score is a number to compare: an earlier version recorded a NaN score
    as null, and promoted it."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def same_setup(record: dict, setup: str) -> bool:
    """Whether an evaluation record was made under `setup` (`evaluation_setup`). A record from
    before setups were recorded never is: the held-out prompts have changed since (HELD_OUT_SPLIT)."""
    return record.get("setup") == setup


async def evaluate(client: EngineClient, model_dir: Path, config: RunConfig, version: int, concurrency: int = 64) -> dict:
    """Score `version` (its snapshot in `model_dir`, already loaded in the engines behind
    `client`) on the held-out prompts. Turns end on the same tokens as in training: the
    tokenizer's and the model's generation-config end tokens (tasks/rollout.py)."""
    tokenizer = load_tokenizer(model_dir)
    env_cls = load_environment(config.env.entrypoint)
    make_env = lambda: env_cls(max_turns=config.env.max_turns, **config.env.kwargs)  # noqa: E731
    prompts = held_out_prompts(config)
    greedy = SamplingParams(
        temperature=0.0, max_new_tokens=config.generation.max_new_tokens, stop_token_ids=model_eos_ids(model_dir)
    )
    limit = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with limit:
            return await run_episode(
                client, make_env, prompt, tokenizer, greedy, max_turns=config.env.max_turns,
                context_length=config.model.max_position_embeddings, loaded_version=version,
                group_id=f"eval-{prompt.prompt_id}", producer="eval", env_timeout_s=config.env.step_timeout_s,
            )  # fmt: skip

    episodes = await asyncio.gather(*(one(p) for p in prompts))
    rewards = [e.reward for e in episodes]  # finite: the rollout fails an episode paid otherwise (a NaN score would be promoted)
    return {
        "version": version,
        "score": sum(rewards) / len(rewards),
        "solved": sum(r >= 1.0 for r in rewards) / len(rewards),
        "prompts": len(rewards),
        "setup": evaluation_setup(config, prompts),
    }
