"""Rollouts: the agent loop, token in and token out.

An episode alternates model turns and environment steps:

    prompt ids -> engine /generate -> model tokens -> decode -> env.step(action)
               -> observation text -> env tokens -> appended -> next /generate ...

until the environment says done, max_turns is reached, or the context is full, before a turn
or during one (the last two ask the environment for the reward of an episode cut short,
`Environment.truncate`: a turn the context cut off is not stepped, its answer or tool call
unfinished; one cut at max_new_tokens with room left is, as the environment's input). Model tokens are
kept exactly as the engine returned them (never decoded and re-encoded), with the engine's
behaviour logprobs and loss_mask 1; environment tokens are encoded once, with loss_mask 0 and
logprob 0. So what the trainer scores is byte-for-byte what the engine sampled.

The environment is the user's code: it is built and called on a thread of the episode's own
(tasks/envthread.py), each call bounded by `env.step_timeout_s`, and what it does wrong fails the
group as `EnvironmentFailed`. An episode's reward is the sum of its steps' rewards (and
`truncate`'s, when the rollout cut it short).

A group is `n` episodes of one prompt, run concurrently: their rewards are normalised together
for the advantage. Each episode records the lowest weight version that produced any of its
tokens (the version its generator had loaded when it started, and every version an engine
reported since), which is what the lag bound must be checked against when weights change
under a running episode.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from transformers import GenerationConfig, PreTrainedTokenizerBase

from infra.engines.api import SamplingParams, oldest_weight_version
from infra.engines.client import EngineClient
from tasks.envs import Environment, Prompt
from tasks.envthread import FLOAT32_MAX, EnvironmentFailed, EnvironmentThread
from tasks.shards import Rollout

EOT_TOKEN = "<eot>"
PROMPT_CHECK_BATCH = 4096
"""Prompts `check_prompts_fit` encodes at once."""
CHARS_PER_TOKEN_BOUND = 32
"""An observation is cut to this many characters per token of room before it is encoded, so that
a tool's multi-megabyte log is not encoded whole on the event loop every episode of the worker
shares (`observation_tokens`)."""
CUT_MARGIN_TOKENS = 64
"""Tokens past the room a cut prefix must give for its first tokens to be the whole text's: a
cut changes the tokens of its last word only."""


def turn_stop_ids(tokenizer: PreTrainedTokenizerBase, model_eos: Iterable[int] = ()) -> list[int]:
    """Tokens that end a model turn: EOS (final answer), the end-of-turn token (tool call) and
    the end tokens of the model's generation config (`model_eos_ids`).

    Passed as stop_token_ids so that every engine ends turns the same way, whatever its own
    reading of the model's generation config, and so that the client knows them all: a sample
    handed off to another engine ends where its aborted part's last token is one of them
    (SGLang keeps the token of the decode step an abort lands in, and the abort wins over the
    end token: infra/engines/handoff.py). A model may end on tokens besides its tokenizer's
    EOS: Qwen's instruct models on <|im_end|> and <|endoftext|>.

    Only the end-of-turn lookup is checked: a tokenizer without <eot> answers it with its unknown
    token (or None). Leaving out the unknown token everywhere dropped the caller's end tokens when
    one was it, and EOS itself for tokenizers whose EOS is their unknown token (GPT-2's)."""
    eot = tokenizer.convert_tokens_to_ids(EOT_TOKEN)
    has_eot = eot is not None and tokenizer.convert_ids_to_tokens(eot) == EOT_TOKEN
    ids = {tokenizer.eos_token_id, *model_eos, *([eot] if has_eot else [])}
    return sorted(i for i in ids if i is not None)


def model_eos_ids(model_dir: Path) -> list[int]:
    """The end tokens an HF model directory names: its generation_config.json's, or without one its
    config.json's, where the engines (transformers' generate, SGLang) take them from then ([]
    if neither names one)."""
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        try:
            eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            return []
    return sorted({eos} if isinstance(eos, int) else {i for i in eos or () if isinstance(i, int)})


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """<bos> + the prompt's tokens (the tokenizer adds no special tokens by itself); just the
    prompt's tokens for a tokenizer without a BOS token (Qwen2 and Qwen3 have none)."""
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return [*bos, *tokenizer.encode(text, add_special_tokens=False)]


def check_prompts_fit(
    prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase, context_length: int, kind: str = "training"
) -> None:
    """PromptTooLong naming the prompts whose text alone leaves no room for a model turn in the
    context. The generator checks its training prompts as it starts, an evaluation its held-out
    ones (`kind` names which): an episode finds out only when its slot comes up, and each such
    prompt of a data set would then be set aside, slot after slot, the data set shrinking
    unannounced. Encoded a batch at a time, keeping lengths only: a million prompts' token ids
    at once are gigabytes of Python lists.

    What is checked is `prompt.text`: an environment whose `reset` adds to it (a chat template)
    can still make an episode too long, which then fails its group alone."""
    bos = 0 if tokenizer.bos_token_id is None else 1
    too_long: list[tuple[str, int]] = []
    for start in range(0, len(prompts), PROMPT_CHECK_BATCH):
        batch = prompts[start : start + PROMPT_CHECK_BATCH]
        lengths = [bos + len(ids) for ids in tokenizer([prompt.text for prompt in batch], add_special_tokens=False)["input_ids"]]
        too_long += [(prompt.prompt_id, n) for prompt, n in zip(batch, lengths, strict=True) if n >= context_length - 1]
    if too_long:
        shown = ", ".join(f"{prompt_id} ({length} tokens)" for prompt_id, length in too_long[:5])
        raise PromptTooLong(
            f"{len(too_long)} of the {len(prompts)} {kind} prompts leave no room for an answer in the model's context of "
            f"{context_length} tokens (model.max_position_embeddings): {shown}{', ...' if len(too_long) > 5 else ''}; "
            "raise it to the model's own context, or leave them out of the environment's prompts"
        )  # fmt: skip


async def run_episode(
    client: EngineClient,
    env: Environment | Callable[[], Environment],
    prompt: Prompt,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    *,
    max_turns: int,
    context_length: int,
    loaded_version: int,
    group_id: str,
    producer: str,
    env_timeout_s: float = 600.0,
) -> Rollout:
    """Play one episode against the engines behind `client`; returns its trajectory.

    `env`: the episode's environment, or what makes it (then made on the episode's thread, so
    that its constructor is bounded and named like its calls: a sandbox it starts, say).
    `env_timeout_s`: the most one call of it may take (`env.step_timeout_s`)."""
    thread = EnvironmentThread(env if not isinstance(env, Environment) else (lambda: env), prompt, env_timeout_s)
    try:
        return await _play(thread, client, prompt, tokenizer, sampling, max_turns=max_turns, context_length=context_length,
                           loaded_version=loaded_version, group_id=group_id, producer=producer)  # fmt: skip
    finally:
        thread.close()


async def _play(
    env: EnvironmentThread, client: EngineClient, prompt: Prompt, tokenizer: PreTrainedTokenizerBase, sampling: SamplingParams, *,
    max_turns: int, context_length: int, loaded_version: int, group_id: str, producer: str,
) -> Rollout:  # fmt: skip
    started = time.time()
    prompt_ids = prompt_token_ids(tokenizer, await env.reset())
    if len(prompt_ids) >= context_length - 1:
        raise PromptTooLong(
            f"prompt {prompt.prompt_id} is {len(prompt_ids)} tokens, leaving no room for an answer in the model's context of "
            f"{context_length} (model.max_position_embeddings): raise it to the model's own context, or leave such prompts out"
        )  # fmt: skip
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    reward, turns, finish, version, generate_seconds = 0.0, 0, "length", loaded_version, 0.0
    stop_ids = turn_stop_ids(tokenizer, sampling.stop_token_ids or ())
    while turns < max_turns:
        room = context_length - len(prompt_ids) - len(completion) - 1  # SGLang refuses input + new >= context
        if room <= 0:
            finish = "length"
            reward += (await env.truncate()).reward
            break
        params = sampling.model_copy(update={"n": 1, "max_new_tokens": min(sampling.max_new_tokens, room), "stop_token_ids": stop_ids})
        call_started = time.monotonic()
        (result,) = await client.generate(prompt_ids + completion, params, return_logprob=True)
        generate_seconds += time.monotonic() - call_started
        meta = result["meta_info"]
        version = min(version, _version_number(oldest_weight_version(meta), version))
        tokens = result["output_ids"]
        finish = meta["finish_reason"]["type"]
        completion += tokens
        mask += [1] * len(tokens)
        # An aborted answer (SGLang's carries fewer fields) ends an episode whose group is not
        # committed but generated again (tasks/worker.py): its logprobs are never trained on.
        logprobs += [0.0] * len(tokens) if finish == "abort" else behaviour_logprobs(meta, tokens)
        turns += 1
        if finish == "abort":
            break
        if finish == "length" and len(tokens) >= room:  # the context filled up mid-turn: an unfinished
            reward += (await env.truncate()).reward   # answer or tool call is not the environment's to judge
            break
        step = await env.step(turn_text(tokenizer, tokens, stop_ids))
        reward += step.reward
        if step.done:
            break
        if turns == max_turns:  # the environment did not end it: nothing follows the last turn
            finish = "max_turns"
            reward += (await env.truncate()).reward
            break
        observation = observation_tokens(tokenizer, step.observation, max(0, context_length - len(prompt_ids) - len(completion)))
        completion += observation
        mask += [0] * len(observation)
        logprobs += [0.0] * len(observation)
    if not abs(reward) <= FLOAT32_MAX:
        raise EnvironmentFailed(f"{env.name} on prompt {prompt.prompt_id}: its steps' rewards sum to {reward}, "
                                "past what a shard stores (float32)")  # fmt: skip
    return Rollout(
        prompt_ids=prompt_ids, completion_ids=completion, loss_mask=mask, behavior_logprobs=logprobs,
        reward=reward, group_id=group_id, policy_version=version, env=env.name,
        turns=turns, finish_reason=finish, producer=producer, started_at=started,
        finished_at=time.time(), generate_seconds=generate_seconds,
    )  # fmt: skip


async def run_group(
    client: EngineClient,
    make_env: Callable[[], Environment],
    prompt: Prompt,
    samples: int,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    **episode_kwargs,
) -> list[Rollout]:
    """`samples` concurrent episodes of one prompt, each with a fresh environment. One that
    raises (an environment's bug, engines that stay away) cancels the others, whose requests
    the engines then abort: with a plain gather they played on, and the group's retry beside them."""
    episodes = [asyncio.ensure_future(run_episode(client, make_env, prompt, tokenizer, sampling, **episode_kwargs))
                for _ in range(samples)]  # fmt: skip
    try:
        return list(await asyncio.gather(*episodes))
    except BaseException:  # the first error, as it is (a TaskGroup would wrap it in an ExceptionGroup)
        for episode in episodes:
            episode.cancel()
        raise


def observation_tokens(tokenizer: PreTrainedTokenizerBase, text: str, room: int) -> list[int]:
    """The first `room` tokens of `text`, encoded once, as a whole: from a prefix of it where that
    gives them for sure (room and a margin of tokens more), else from all of it (a text of long
    tokens: runs of whitespace or separators that a tokenizer keeps whole)."""
    prefix = text[: CHARS_PER_TOKEN_BOUND * (room + CUT_MARGIN_TOKENS)]
    tokens = tokenizer.encode(prefix, add_special_tokens=False)
    if len(prefix) < len(text) and len(tokens) < room + CUT_MARGIN_TOKENS:
        tokens = tokenizer.encode(text, add_special_tokens=False)
    return tokens[:room]


def turn_text(tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop_ids: Iterable[int]) -> str:
    """A model turn as the environment reads it: without the stop token that closed it, and with
    every other special token left in as text. Decoding with skip_special_tokens dropped them
    anywhere in the turn, so "ANSWER 8 <pad> 2" scored as "ANSWER 8 2" and stray special tokens
    cost the policy nothing."""
    closed = bool(tokens) and tokens[-1] in set(stop_ids)
    return tokenizer.decode(tokens[:-1] if closed else tokens, skip_special_tokens=False)


def behaviour_logprobs(meta: dict, tokens: list[int]) -> list[float]:
    """The engine's logprob of each token of its answer, from meta_info.output_token_logprobs
    ([logprob, token id, text] per token); EngineAnswerError unless there is one finite logprob
    per token, for that token. A list one entry short or shifted (an engine or a hand-off part
    that left one out) would otherwise pass every later check and train each token against
    another's probability."""
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(tokens):
        given = f"{len(entries)} entries" if isinstance(entries, list) else repr(entries)
        raise EngineAnswerError(f"an engine answered {len(tokens)} tokens with output_token_logprobs of {given}: "
                                "tandem needs one logprob per generated token")  # fmt: skip
    logprobs = []
    for index, (entry, token) in enumerate(zip(entries, tokens)):
        logprob = entry[0] if isinstance(entry, (list, tuple)) and len(entry) >= 2 and entry[1] == token else None
        if type(logprob) not in (int, float) or not math.isfinite(logprob):
            raise EngineAnswerError(f"an engine's output_token_logprobs[{index}] is {entry!r} for token {token}: "
                                    "tandem needs [logprob, token id, ...] with a finite logprob, for that token")  # fmt: skip
        logprobs.append(float(logprob))
    return logprobs


class EngineAnswerError(ValueError):
    """An engine's /generate answer that does not give what the trainer needs of it."""


class PromptTooLong(ValueError):
    """A prompt that leaves no room for a model turn in the context: no episode can be played."""


def _version_number(reported: str | None, fallback: int) -> int:
    """An engine's weight_version as an int; SGLang's default name "default" means unknown."""
    try:
        return int(reported) if reported is not None else fallback
    except ValueError:
        return fallback
