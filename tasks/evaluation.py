"""Evaluation: greedy decoding of held-out prompts against engines serving a pinned snapshot.

It runs the same rollout code as training (tasks/rollout.py) with temperature 0 and one sample
per prompt, so what is measured is exactly the agent loop that is trained, multi-turn tool calls
included. The score is the mean reward, and `solved` the fraction of episodes with reward 1.

An episode its environment fails (a tool that times out or raises, a reward that is not finite)
is left out of both and counted in `failed`, as training sets such a group aside: a flaky tool
costs its episodes, not the run's opening or closing evaluation. Past FAILED_SHARE_LIMIT of the
held-out prompts, the evaluation fails itself (`EvaluationFailed`): a score over the few that
were played would be compared as if it were the held-out set's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from pathlib import Path

from configs.schema import RunConfig
from infra.engines.api import SamplingParams
from infra.engines.client import EngineClient
from infra.modelfactory import load_tokenizer
from tasks.envs import Prompt, environment_factory
from tasks.envthread import EnvironmentFailed
from tasks.rollout import PromptTooLong, check_prompts_fit, model_eos_ids, run_episode

log = logging.getLogger(__name__)


HELD_OUT_SPLIT = 2
"""Which held-out prompts the built-in environments draw: 2 since a problem is held out only if
its operands-swapped twin is too (tasks/envs/base.py `sample_prompts`); scores recorded under
another are not this one's."""
FAILED_SHARE_LIMIT = 0.5
"""The largest share of held-out episodes an environment may fail in an evaluation that scores."""


class EvaluationFailed(RuntimeError):
    """The environment failed too many held-out episodes for the rest to score the snapshot."""


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
    make_env = environment_factory(config.env.entrypoint, config.env.max_turns, config.env.kwargs)
    return make_env().prompts("eval", config.env.eval_prompts, config.seed)


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
    tokenizer's and the model's generation-config end tokens (tasks/rollout.py).

    PromptTooLong at once if a held-out prompt cannot fit the context (that is the config's to
    fix, not a failure to count); EvaluationFailed if the environment fails more than
    FAILED_SHARE_LIMIT of the episodes."""
    tokenizer = load_tokenizer(model_dir)
    make_env = environment_factory(config.env.entrypoint, config.env.max_turns, config.env.kwargs)
    prompts = held_out_prompts(config)
    check_prompts_fit(prompts, tokenizer, config.model.max_position_embeddings, kind="held-out")
    greedy = SamplingParams(
        temperature=0.0, max_new_tokens=config.generation.max_new_tokens, stop_token_ids=model_eos_ids(model_dir)
    )
    limit = asyncio.Semaphore(concurrency)

    async def one(prompt) -> float | str:
        """The episode's reward, or why its environment failed it."""
        async with limit:
            try:
                episode = await run_episode(
                    client, make_env, prompt, tokenizer, greedy, max_turns=config.env.max_turns,
                    context_length=config.model.max_position_embeddings, loaded_version=version,
                    group_id=f"eval-{prompt.prompt_id}", producer="eval", env_timeout_s=config.env.step_timeout_s,
                )  # fmt: skip
            except (EnvironmentFailed, PromptTooLong) as failure:  # PromptTooLong: what `reset` added to the text
                return str(failure)
            return episode.reward  # finite: the rollout fails an episode paid otherwise (a NaN score would be promoted)

    outcomes = await asyncio.gather(*(one(p) for p in prompts))
    failures = [o for o in outcomes if isinstance(o, str)]
    rewards = [o for o in outcomes if not isinstance(o, str)]
    if len(failures) > FAILED_SHARE_LIMIT * len(prompts):
        raise EvaluationFailed(f"the environment failed {len(failures)} of {len(prompts)} held-out episodes of v{version}, "
                               f"more than {FAILED_SHARE_LIMIT:.0%}; the first: {failures[0]}")  # fmt: skip
    if failures:
        log.warning("left %d of %d held-out episodes of v%d out of the score: the environment failed them; the first: %s",
                    len(failures), len(prompts), version, failures[0])  # fmt: skip
    return {
        "version": version,
        "score": sum(rewards) / len(rewards),
        "solved": sum(r >= 1.0 for r in rewards) / len(rewards),
        "prompts": len(prompts),
        "failed": len(failures),
        "setup": evaluation_setup(config, prompts),
    }
