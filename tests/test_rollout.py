"""The agent loop (tasks/rollout.py) against a real CPU engine on loopback: what a trajectory holds.

The trainer scores exactly what a rollout records, so these check it token by token: model tokens
with the engine's behaviour logprobs under loss_mask 1, environment tokens under loss_mask 0, the
context bound, and the weight version the lag bound is checked against.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import time
from itertools import groupby
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from configs.schema import RunConfig
from infra.engines.api import SamplingParams
from infra.engines.client import EngineClient
from infra.engines.process import cpu_engine_process
from infra.modelfactory import build_tokenizer, load_tokenizer
from infra.ports import free_port_block
from tasks.envs import Environment, Prompt, StepResult
from tasks.envs.calculator import CalculatorEnv
from tasks.evaluation import EvaluationFailed, evaluate
from tasks.rollout import (
    EngineAnswerError, EnvironmentFailed, PromptTooLong, behaviour_logprobs, check_prompts_fit, model_eos_ids, prompt_token_ids,
    run_episode, run_group, turn_stop_ids, turn_text,
)
from tests.conftest import committed_model_dir, reference_logprobs

pytestmark = pytest.mark.slow

OBSERVATION = " 7 <eot>"
"""What the tool answers each turn: in the tiny tokenizer's vocabulary."""


class ToolEnv(Environment):
    """Answers every turn with OBSERVATION; done after `max_turns`, with reward 1 for trying."""

    def reset(self, prompt: Prompt) -> str:
        self.turns = 0
        return prompt.text

    def step(self, action: str) -> StepResult:
        self.turns += 1
        done = self.turns >= self.max_turns
        return StepResult("" if done else OBSERVATION, 1.0 if done else 0.0, done, {})

    def prompts(self, split, count, seed):
        return [Prompt(f"{split}-{i}", "1 + 2 =", "3") for i in range(count)]

    def demonstration(self, prompt):
        return []


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A CPU engine serving weight version 4 of a tiny model (context 64)."""
    root = tmp_path_factory.mktemp("rollout")
    model = committed_model_dir(root / "model", seed=0)
    process = cpu_engine_process(model, free_port_block(count=1), root / "engine.log", weight_version="4")
    with process.start(timeout=120):
        yield model, process.url


def episode(engine, max_turns: int, max_new_tokens: int, loaded_version: int):
    model, url = engine
    tokenizer = load_tokenizer(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)

    async def play():
        async with EngineClient([url]) as client:
            return await run_episode(
                client, ToolEnv(max_turns), ToolEnv(max_turns).prompts("train", 1, 0)[0], tokenizer, sampling,
                max_turns=max_turns, context_length=64, loaded_version=loaded_version, group_id="g0", producer="gen0",
            )  # fmt: skip

    return model, tokenizer, asyncio.run(play())


def test_model_tokens_carry_the_engines_logprobs_and_tool_tokens_are_masked_out(engine):
    model, tokenizer, rollout = episode(engine, max_turns=3, max_new_tokens=4, loaded_version=9)
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    assert rollout.prompt_ids == prompt_token_ids(tokenizer, "1 + 2 =")
    runs = [(mask, [t for _, t in run]) for mask, run in groupby(zip(rollout.loss_mask, rollout.completion_ids), key=lambda p: p[0])]
    assert [mask for mask, _ in runs] == [1, 0, 1, 0, 1], "three model turns, two tool answers between them"
    assert all(1 <= len(tokens) <= 4 for mask, tokens in runs if mask), "a turn is at most max_new_tokens"
    assert all(tokens == observation for mask, tokens in runs if not mask), "tool text is encoded once, as is"
    assert all(lp == 0.0 for lp, m in zip(rollout.behavior_logprobs, rollout.loss_mask) if m == 0)
    reference = reference_logprobs(model, rollout.prompt_ids, rollout.completion_ids)
    served = [lp for lp, m in zip(rollout.behavior_logprobs, rollout.loss_mask) if m]
    assert served == pytest.approx([lp for lp, m in zip(reference, rollout.loss_mask) if m], abs=1e-4), (
        "the model's tokens are scored as the engine sampled them, in the context the trainer sees"
    )
    assert (rollout.turns, rollout.reward) == (3, 1.0)
    assert rollout.policy_version == 4, "an episode is as old as the weights that produced its tokens"


def test_an_episode_ends_at_the_context_without_a_request_the_engine_refuses(engine):
    """Every turn asks for at most the context minus the tokens so far minus one: the engine (as
    SGLang) answers 400 to input + max_new_tokens >= its context, which would end the episode."""
    _, _, rollout = episode(engine, max_turns=50, max_new_tokens=16, loaded_version=4)
    assert len(rollout.prompt_ids) + len(rollout.completion_ids) <= 64
    assert rollout.finish_reason == "length" and rollout.turns < 50, "it ended at the context, not by its turns"
    assert len(rollout.completion_ids) == len(rollout.loss_mask) == len(rollout.behavior_logprobs)


def test_the_callers_stop_tokens_end_a_turn_beside_the_tokenizers(engine):
    """The generator passes the model's generation-config end tokens: any of them ends a turn."""
    model, url = engine
    tokenizer = load_tokenizer(model)
    every_token = list(range(len(tokenizer)))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, stop_token_ids=every_token)

    async def play():
        async with EngineClient([url]) as client:
            return await run_episode(
                client, ToolEnv(2), ToolEnv(2).prompts("train", 1, 0)[0], tokenizer, sampling,
                max_turns=2, context_length=64, loaded_version=4, group_id="g0", producer="gen0",
            )  # fmt: skip

    rollout = asyncio.run(play())
    assert [mask for mask, _ in groupby(rollout.loss_mask)] == [1, 0, 1]
    assert rollout.loss_mask.count(1) == 2, "each turn ended on its first token"


def test_the_models_end_tokens_come_from_its_generation_config(tmp_path: Path):
    assert model_eos_ids(tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert model_eos_ids(tmp_path) == [7], "without a generation config, the model config's, as the engines take"
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert model_eos_ids(tmp_path) == [151643, 151645]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert model_eos_ids(tmp_path) == [2]
    tokenizer = load_tokenizer(committed_model_dir(tmp_path / "m", seed=0))
    assert set(turn_stop_ids(tokenizer)) | {151643} == set(turn_stop_ids(tokenizer, [151643]))



def test_every_end_token_stays_a_stop_token_though_it_is_the_tokenizers_unknown_token():
    """The unknown token was left out of the stop tokens (to drop a missing <eot>'s lookup), so a
    caller's end token that was it did not end a turn, nor EOS where it is the unknown token."""
    tokenizer = build_tokenizer()
    eos, eot, unk = (tokenizer.convert_tokens_to_ids(t) for t in ("<eos>", "<eot>", "<unk>"))
    assert turn_stop_ids(tokenizer) == sorted({eos, eot})
    assert unk in turn_stop_ids(tokenizer, [unk]), "a caller's end token is kept, whatever it is"
    core = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="<|endoftext|>"))
    gpt2_like = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    assert turn_stop_ids(gpt2_like) == [0], "EOS is the unknown token, and there is no <eot>"


class OneTokenEnv(Environment):
    """Single turn; reward 1 when the model's answer is at most one token long."""

    def prompts(self, split, count, seed):
        return [Prompt(f"{split}-{i}", f"{i} + 2 =", "") for i in range(count)]

    def reset(self, prompt: Prompt) -> str:
        return prompt.text

    def step(self, action: str) -> StepResult:
        return StepResult("", float(len(action.split()) <= 1), True, {})

    def demonstration(self, prompt: Prompt):
        return []


def test_evaluation_ends_turns_on_the_models_end_tokens(engine, tmp_path: Path):
    """Held-out episodes sample as training's do: a generation config naming every token as an
    end token ends each answer on its first token; without it, greedy answers run longer."""
    model, url = engine
    config = RunConfig.model_validate({
        "env": {"entrypoint": "tests.test_rollout:OneTokenEnv", "kwargs": {}, "eval_prompts": 8, "max_turns": 1},
        "generation": {"max_new_tokens": 6},
    })  # fmt: skip
    every_token_ends = shutil.copytree(model, tmp_path / "model")
    vocabulary = len(load_tokenizer(model))
    (every_token_ends / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(vocabulary))}))

    async def score(model_dir: Path) -> float:
        async with EngineClient([url]) as client:
            return (await evaluate(client, model_dir, config, version=4))["score"]

    assert asyncio.run(score(every_token_ends)) == 1.0
    assert asyncio.run(score(model)) < 1.0, "the control: the engine's own end tokens do not end answers this early"



class NanRewardEnv(OneTokenEnv):
    """OneTokenEnv whose reward is NaN on the held-out prompts `nan_on` names: an environment's bug."""

    def __init__(self, max_turns: int, nan_on: list[str]):
        super().__init__(max_turns)
        self.nan_on = nan_on

    def reset(self, prompt: Prompt) -> str:
        self.prompt_id = prompt.prompt_id
        return prompt.text

    def step(self, action: str) -> StepResult:
        return StepResult("", float("nan") if self.prompt_id in self.nan_on else 1.0, True, {})


def evaluate_nan_env(url: str, model: Path, nan_on: list[str], prompts: int = 8) -> dict:
    config = RunConfig.model_validate({
        "env": {"entrypoint": "tests.test_rollout:NanRewardEnv", "kwargs": {"nan_on": nan_on}, "eval_prompts": prompts, "max_turns": 1},
    })  # fmt: skip

    async def score() -> dict:
        async with EngineClient([url]) as client:
            return await evaluate(client, model, config, version=4)

    return asyncio.run(score())


def test_an_evaluation_leaves_out_the_episodes_its_environment_failed(engine):
    """One held-out episode an environment failed (here: a NaN reward) failed the whole
    evaluation, and with it the pipeline run, before training or after all of it; training
    only sets such a group aside. A NaN must still never reach the score: it was recorded (as
    null) and promoted, since nothing compares above NaN."""
    model, url = engine
    result = evaluate_nan_env(url, model, nan_on=["eval-3"])
    assert result["failed"] == 1 and result["prompts"] == 8
    assert result["score"] == 1.0 and result["solved"] == 1.0, "scored over the seven the environment paid"


def test_an_evaluation_whose_environment_fails_most_episodes_fails_naming_the_first(engine):
    model, url = engine
    with pytest.raises(EvaluationFailed, match=r"failed 5 of 8 held-out episodes of v4.*returned the reward nan"):
        evaluate_nan_env(url, model, nan_on=[f"eval-{i}" for i in range(5)])
    assert evaluate_nan_env(url, model, nan_on=[f"eval-{i}" for i in range(4)])["failed"] == 4, "half still scores"


class LongPromptEnv(OneTokenEnv):
    def prompts(self, split, count, seed):
        return [Prompt(f"{split}-{i}", "1 + " * 20 + "2 =", "") for i in range(count)]


def test_an_evaluation_refuses_held_out_prompts_longer_than_the_context(engine):
    """Before: each such episode raised PromptTooLong out of the evaluation, and it failed the
    run; now the held-out prompts are checked first, named as such."""
    model, url = engine
    config = RunConfig.model_validate({
        "env": {"entrypoint": "tests.test_rollout:LongPromptEnv", "kwargs": {}, "eval_prompts": 2, "max_turns": 1},
        "model": {"max_position_embeddings": 16},
    })  # fmt: skip

    async def score() -> dict:
        async with EngineClient([url]) as client:
            return await evaluate(client, model, config, version=4)

    with pytest.raises(PromptTooLong, match="of the 2 held-out prompts leave no room"):
        asyncio.run(score())


def test_a_prompt_starts_with_bos_only_where_the_tokenizer_has_one():
    """Qwen2 and Qwen3 tokenizers have no BOS token: a None at the head of every prompt failed
    the warm-start's batch and every /generate."""
    from infra.modelfactory import build_tokenizer
    from tasks.rollout import prompt_token_ids

    tokenizer = build_tokenizer()
    with_bos = prompt_token_ids(tokenizer, "1+2")
    assert with_bos[0] == tokenizer.bos_token_id and len(with_bos) > 1
    tokenizer.bos_token = None
    assert prompt_token_ids(tokenizer, "1+2") == with_bos[1:]


class CutShortEnv(ToolEnv):
    """ToolEnv that never ends an episode itself, and scores one cut short at -0.5."""

    def step(self, action: str) -> StepResult:
        return StepResult(OBSERVATION, 0.0, False, {})

    def truncate(self) -> StepResult:
        return StepResult("", -0.5, True, {"end": "truncated"})


def play(engine, env_class, max_turns: int, context_length: int = 64, prompt_text: str = "1 + 2 =", max_new_tokens: int = 16):
    model, url = engine
    tokenizer = load_tokenizer(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)

    async def episode():
        async with EngineClient([url]) as client:
            return await run_episode(
                client, env_class(max_turns), Prompt("train-0", prompt_text, "3"), tokenizer, sampling,
                max_turns=max_turns, context_length=context_length, loaded_version=4, group_id="g0", producer="gen0",
            )  # fmt: skip

    return asyncio.run(episode())


def test_an_episode_cut_short_is_scored_by_the_environment_and_ends_on_a_model_turn(engine):
    """At the context or after the last turn with the environment not done, the reward is the
    environment's for an episode cut short: before, it was the last step's 0.0, which paid a
    policy better than the penalties of an episode that ran out of turns (CalculatorEnv)."""
    at_context = play(engine, CutShortEnv, max_turns=50)
    assert (at_context.reward, at_context.finish_reason) == (-0.5, "length") and at_context.turns < 50
    out_of_turns = play(engine, CutShortEnv, max_turns=2)
    assert out_of_turns.reward == -0.5 and out_of_turns.turns == 2
    assert [mask for mask, _ in groupby(out_of_turns.loss_mask)] == [1, 0, 1], "no tool answer after the last turn"


class AnswerEnv(CutShortEnv):
    """Takes whatever the first turn says as the final answer, and pays 1 for it."""

    def step(self, action: str) -> StepResult:
        return StepResult("", 1.0, True, {})


def test_a_turn_the_context_cuts_off_is_scored_as_an_episode_cut_short_not_as_an_answer(engine):
    """A turn that fills the context ends without its stop token: its answer (or its tool call)
    is unfinished, and was judged (or run) as if it were whole."""
    model, _ = engine
    room = 3
    context = len(prompt_token_ids(load_tokenizer(model), "1 + 2 =")) + room + 1
    # The random model samples its turn's stop token within the room now and then (about 1 run in
    # 20): that turn is whole, and paid. Played again until the context cuts one, which is the case.
    played = [play(engine, AnswerEnv, max_turns=5, context_length=context) for _ in range(20)]
    cut = next(episode for episode in played if episode.finish_reason == "length")
    assert (cut.reward, cut.turns, len(cut.completion_ids)) == (-0.5, 1, room)
    assert all(episode.reward == 1.0 for episode in played if episode.finish_reason == "stop"), "a whole turn is judged"
    whole = play(engine, AnswerEnv, max_turns=5)
    assert whole.reward == 1.0, "a turn cut at max_new_tokens with room left is the environment's to judge"


def test_the_calculator_charges_the_malformed_calls_of_an_episode_cut_short():
    env = CalculatorEnv(max_turns=8, malformed_penalty=0.1)
    env.reset(env.prompts("train", 1, 0)[0])
    for _ in range(4):
        assert not env.step("a b c").done
    assert env.truncate().reward == pytest.approx(-0.4)


def test_a_turn_reaches_the_environment_without_its_closing_stop_token_and_with_any_other_special_token():
    tokenizer = build_tokenizer()
    stops = turn_stop_ids(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    answer = [ids(t) for t in ("ANSWER", "8", "2", "<eos>")]
    assert turn_text(tokenizer, answer, stops) == "ANSWER 8 2"
    padded = [ids(t) for t in ("ANSWER", "8", "<pad>", "2", "<eos>")]
    assert turn_text(tokenizer, padded, stops) == "ANSWER 8 <pad> 2"
    env = CalculatorEnv(max_turns=2)
    env.reset(Prompt("train-0", "Q 3 5 + 4 7", "8 2"))
    assert env.step(turn_text(tokenizer, padded, stops)).reward == 0.0, "before, it scored 1.0: the <pad> was dropped"
    assert turn_text(tokenizer, answer[:-1], stops) == "ANSWER 8 2", "a turn cut at max_new_tokens has no stop token"


class BrokenOnceEnv(ToolEnv):
    """The first episode made raises at its first step; the others play on, counting their steps."""

    made = 0
    steps = 0

    def __init__(self, max_turns: int):
        super().__init__(max_turns)
        BrokenOnceEnv.made += 1
        self.broken = BrokenOnceEnv.made == 1

    def step(self, action: str) -> StepResult:
        if self.broken:
            raise KeyError("environment bug")
        BrokenOnceEnv.steps += 1
        return StepResult(OBSERVATION, 0.0, False, {})


def test_an_episode_that_raises_cancels_the_rest_of_its_group_naming_the_environment_and_prompt(engine):
    """Before, the others played on against the engines after the group had failed, beside its retry.
    A step already called when the group fails (its thread may run late on a busy machine) still
    runs: at most one for each of the three others, where playing on would be dozens a second."""
    model, url = engine
    tokenizer = load_tokenizer(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)

    async def group_then_wait() -> tuple[int, int]:
        async with EngineClient([url]) as client:
            with pytest.raises(EnvironmentFailed, match="BrokenOnceEnv.step on prompt train-7 raised KeyError: 'environment bug'"):
                await run_group(client, lambda: BrokenOnceEnv(50), Prompt("train-7", "1 + 2 =", "3"), 4, tokenizer, sampling,
                                max_turns=50, context_length=64, loaded_version=4, group_id="g0", producer="gen0")  # fmt: skip
            failed_at = BrokenOnceEnv.steps
            await asyncio.sleep(1.0)
            return failed_at, BrokenOnceEnv.steps

    failed_at, later = asyncio.run(group_then_wait())
    assert later - failed_at <= 3, f"{later - failed_at} steps played after the group failed"


class SlowToolEnv(ToolEnv):
    """A tool call that blocks for `seconds` (sleep stands in for a subprocess or an HTTP call)."""

    def __init__(self, max_turns: int, seconds: float, calls: list | None = None):
        super().__init__(max_turns)
        self.seconds, self.calls = seconds, calls

    def step(self, action: str) -> StepResult:
        started = time.monotonic()
        time.sleep(self.seconds)
        if self.calls is not None:
            self.calls.append((started, time.monotonic()))
        return super().step(action)


def play_group(engine, make_env, samples: int, env_timeout_s: float = 600.0, max_turns: int = 1):
    model, url = engine
    tokenizer = load_tokenizer(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)

    async def play():
        async with EngineClient([url]) as client:
            return await run_group(client, make_env, Prompt("train-3", "1 + 2 =", "3"), samples, tokenizer, sampling,
                                   max_turns=max_turns, context_length=64, loaded_version=4, group_id="g0", producer="gen0",
                                   env_timeout_s=env_timeout_s)  # fmt: skip

    return asyncio.run(play())


def test_blocking_tool_calls_of_a_group_run_side_by_side_off_the_event_loop(engine):
    """Called on the event loop, eight 1-second tool calls took 8 s, and held every other episode
    of the worker (and its engine timeouts) meanwhile."""
    calls: list[tuple[float, float]] = []
    rollouts = play_group(engine, lambda: SlowToolEnv(1, seconds=1.0, calls=calls), samples=8)
    assert [r.reward for r in rollouts] == [1.0] * 8 and len(calls) == 8
    overlapping = max(sum(start <= moment < end for start, end in calls) for moment, _ in calls)
    assert overlapping >= 2, f"the 8 tool calls ran one after another: {calls}"


def test_a_tool_call_that_outlasts_the_timeout_fails_its_group(engine):
    started = time.monotonic()
    with pytest.raises(EnvironmentFailed, match=r"SlowToolEnv.step on prompt train-3 took longer than env.step_timeout_s \(0.5 s\)"):
        play_group(engine, lambda: SlowToolEnv(1, seconds=30.0), samples=2, env_timeout_s=0.5)
    assert time.monotonic() - started < 10, "the group waited for the hung call"


class SqliteToolEnv(ToolEnv):
    """A text-to-SQL style tool: a connection opened as the environment is built, queried at each
    step. sqlite refuses a connection used from another thread than its own."""

    def __init__(self, max_turns: int):
        super().__init__(max_turns)
        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table t (x)")

    def step(self, action: str) -> StepResult:
        self.db.execute("insert into t values (1)")
        return super().step(action)


def test_an_environment_is_built_and_called_on_one_thread_of_its_episodes_own(engine):
    """With a thread per call, 41 of 50 such episodes failed with sqlite's ProgrammingError."""
    rollouts = play_group(engine, lambda: SqliteToolEnv(3), samples=8, max_turns=3)
    assert [r.reward for r in rollouts] == [1.0] * 8 and {r.env for r in rollouts} == {"SqliteToolEnv"}


def test_a_constructor_that_raises_fails_its_group_naming_the_prompt(engine):
    def broken() -> ToolEnv:
        raise OSError("sandbox image not found")

    with pytest.raises(EnvironmentFailed, match="building the environment .* for prompt train-3 raised OSError: sandbox image"):
        play_group(engine, broken, samples=2)


class PaysEachStepEnv(ToolEnv):
    """Pays 0.25 a step, and `truncate` -1 when the turns run out."""

    def step(self, action: str) -> StepResult:
        return StepResult(OBSERVATION, 0.25, False, {})

    def truncate(self) -> StepResult:
        return StepResult("", -1.0, True, {})


def test_an_episodes_reward_sums_its_steps_and_a_cut_by_the_turns_says_so(engine):
    (rollout,) = play_group(engine, lambda: PaysEachStepEnv(3), samples=1, max_turns=3)
    assert rollout.reward == pytest.approx(3 * 0.25 - 1.0), "before, only the last step's (or truncate's) reward was kept"
    assert (rollout.turns, rollout.finish_reason) == (3, "max_turns"), "before, it read 'stop' as if the environment had ended it"


class BadRewardEnv(ToolEnv):
    def __init__(self, max_turns: int, reward: object):
        super().__init__(max_turns)
        self.reward = reward

    def step(self, action: str) -> StepResult:
        return StepResult("", self.reward, True, {})


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), 1e39, "1.0", None, True])
def test_a_reward_a_shard_cannot_store_fails_its_group_naming_it(engine, reward):
    """1e39 is finite in Python and inf in the shard's float32 column; the shard's own check then
    failed the group with 'reward must be finite: row 0', naming neither environment nor prompt."""
    with pytest.raises(EnvironmentFailed, match=r"BadRewardEnv.step on prompt train-3 returned the reward"):
        play_group(engine, lambda: BadRewardEnv(1, reward), samples=1)


def test_a_prompt_that_leaves_no_room_in_the_context_is_refused_naming_the_setting(engine):
    with pytest.raises(PromptTooLong, match=r"prompt train-0 is \d+ tokens.*model.max_position_embeddings"):
        play(engine, ToolEnv, max_turns=1, prompt_text=" ".join(["1"] * 70))


@pytest.mark.parametrize("batch", [4096, 2])
def test_the_generators_check_names_every_prompt_too_long_for_the_context_before_any_is_played(engine, batch, monkeypatch):
    """Also encoded two prompts at a time: the names and counts span the batches."""
    monkeypatch.setattr("tasks.rollout.PROMPT_CHECK_BATCH", batch)
    model, _ = engine
    tokenizer = load_tokenizer(model)
    prompts = [Prompt(f"train-{i}", " ".join(["1"] * length), "1") for i, length in enumerate([3, 61, 62, 70, 10])]
    check_prompts_fit(prompts[:2], tokenizer, context_length=64)  # <bos> + 61 tokens leaves one for the answer
    with pytest.raises(PromptTooLong, match=r"^2 of the 5 training prompts .* context of 64 tokens \(model.max_position_embeddings\): "
                                            r"train-2 \(63 tokens\), train-3 \(71 tokens\); raise it"):
        check_prompts_fit(prompts, tokenizer, context_length=64)


def test_a_chat_templates_special_tokens_written_as_text_are_encoded_as_those_tokens():
    """What the README tells an environment for a chat model to do: write the template's turns
    as text. The prompt and observations are encoded with the special tokens as tokens (not as
    the characters '<', '|', ...), and the action is the turn without its end token."""
    from infra.modelfactory import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = prompt_token_ids(tokenizer, "<|im_start|>user\n1 + 2<|im_end|>\n<|im_start|>assistant\n")
    assert [i for i in ids if i in (start, end)] == [start, end, start]
    three = tokenizer.convert_tokens_to_ids("3")
    assert turn_text(tokenizer, [three, end], turn_stop_ids(tokenizer, [end])) == "3"


@pytest.mark.parametrize(
    "entries, named",
    [
        (None, "output_token_logprobs of None"),
        ([[-0.5, 7, None]], "3 tokens with output_token_logprobs of 1 entries"),
        ([[-0.5, 7, None], [-0.1, 9, None], [-0.2, 8, None]], r"\[1\] is \[-0.1, 9, None\] for token 8"),
        ([[-0.5, 7, None], [None, 8, None], [-0.2, 9, None]], r"\[1\] is \[None, 8, None\]"),
        ([[-0.5, 7, None], [float("nan"), 8, None], [-0.2, 9, None]], r"\[1\] is \[nan, 8, None\]"),
    ],
    ids=["missing", "short", "shifted", "null", "nan"],
)
def test_an_answer_without_one_finite_logprob_for_each_of_its_tokens_is_refused(entries, named):
    """A list one short or shifted would otherwise train each later token against another's probability."""
    with pytest.raises(EngineAnswerError, match=named):
        behaviour_logprobs({"output_token_logprobs": entries}, [7, 8, 9])
    assert behaviour_logprobs({"output_token_logprobs": [[-0.5, 7, None], [-1, 8, "x"], [0.0, 9]]}, [7, 8, 9]) == [-0.5, -1.0, 0.0]


LONG_OBSERVATION = " 7" * 100_000 + " <eot>"


class FloodEnv(ToolEnv):
    """ToolEnv whose tool answers with 100,000 tokens: a log far past the context."""

    def step(self, action: str) -> StepResult:
        return StepResult(LONG_OBSERVATION, 0.0, False, {})


def test_an_observation_past_the_context_is_cut_to_fill_it_exactly(engine):
    """The tool's answer is cut to the room the context leaves, from its start, and the episode
    then ends at the context: the encoding of a character prefix (not of the whole log, on the
    event loop every episode of the worker shares) gives the same tokens."""
    tokenizer = load_tokenizer(engine[0])
    rollout = play(engine, FloodEnv, max_turns=3, max_new_tokens=4)
    model_turn = rollout.loss_mask.index(0)
    observation = rollout.completion_ids[model_turn:]
    assert len(rollout.prompt_ids) + len(rollout.completion_ids) == 64, "the observation fills the context"
    assert set(rollout.loss_mask[model_turn:]) == {0} and rollout.turns == 1 and rollout.finish_reason == "length"
    assert observation == tokenizer.encode(LONG_OBSERVATION, add_special_tokens=False)[: len(observation)]


def test_an_observation_is_cut_to_the_same_tokens_as_the_whole_text_gives():
    """A prefix of 32 characters per token of room gave fewer tokens than the room where a
    tokenizer keeps long runs whole (here: 100-character words, each one <unk>), and the
    observation came out shorter than the context allowed."""
    from infra.modelfactory import build_tokenizer
    from tasks.rollout import observation_tokens

    tokenizer = build_tokenizer()
    for text in (" 7" * 100_000, ("x" * 100 + " ") * 1_000, " 7 8"):
        whole = tokenizer.encode(text, add_special_tokens=False)
        for room in (0, 1, 50, 500):
            assert observation_tokens(tokenizer, text, room) == whole[:room], (text[:20], room)
