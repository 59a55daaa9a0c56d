"""Environments: deterministic disjoint prompts in the tiny vocabulary, demonstrations that play
through step() with reward 1, robust parsing of any action text, partial credit, the entrypoint
loader, and prompt files (JSONL, Parquet) with their split."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from configs.sections import EnvConfig
from infra.modelfactory import TASK_VOCABULARY, build_tokenizer
from tasks.envs import (
    Environment,
    EnvironmentLoadError,
    Prompt,
    Segment,
    StepResult,
    load_environment,
    load_prompts,
    split_prompts,
)
from tasks.envs.arithmetic import AdditionEnv
from tasks.envs.base import is_held_out
from tasks.envs.calculator import CalculatorEnv
from tasks.rollout import turn_stop_ids, turn_text

UNK_ID = 3
CALC_PROMPT = Prompt("c", "Q 3 7 + 4 5", "8 2")
ADDITION_PROMPT = Prompt("a", "3 7 + 4 5 =", "8 2")
ENVS = {
    "addition": lambda: AdditionEnv(),
    "calculator": lambda: CalculatorEnv(),
    "calculator-all-ops": lambda: CalculatorEnv(ops=["+", "-", "*"]),
    "calculator-one-turn": lambda: CalculatorEnv(max_turns=1),
}


class EchoEnv(Environment):
    """A user environment loaded by entrypoint: reward 1 when the model repeats the prompt."""

    def __init__(self, max_turns: int, suffix: str = "") -> None:
        super().__init__(max_turns)
        self.suffix = suffix

    def prompts(self, split, count, seed):
        return [Prompt(f"{split}-{seed}-{i}", f"{split} {i}", f"{split} {i}") for i in range(count)]

    def reset(self, prompt):
        self.prompt = prompt
        return prompt.text + self.suffix

    def step(self, action):
        return StepResult("", float(action == self.prompt.answer), True, {})

    def demonstration(self, prompt):
        return [Segment(f"{prompt.answer} <eos>", from_model=True)]


def not_a_class() -> None:
    """An attribute that is not an Environment class."""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def play(env: Environment, prompt: Prompt, segments: list[Segment], tokenizer):
    """Feed the model segments as the rollout would: each turn's tokens decoded without the stop
    token that closed it, any other special token left in as text (tasks/rollout.py `turn_text`)."""
    assert env.reset(prompt) == prompt.text
    observations, result = [], None
    for segment in segments:
        if segment.from_model:
            assert result is None or not result.done
            tokens = tokenizer.encode(segment.text, add_special_tokens=False)
            action = turn_text(tokenizer, tokens, turn_stop_ids(tokenizer))
            result = env.step(action)
            observations += [result.observation] if result.observation else []
    return result, observations


@pytest.mark.parametrize("name", ENVS)
def test_prompts_deterministic_and_disjoint(name):
    env = ENVS[name]()
    train, held_out = env.prompts("train", 2000, seed=7), env.prompts("eval", 300, seed=7)
    assert train == ENVS[name]().prompts("train", 2000, seed=7)
    assert train != env.prompts("train", 2000, seed=8)
    other_seed = {p.text for p in env.prompts("train", 2000, seed=8)}
    assert not {p.text for p in held_out} & ({p.text for p in train} | other_seed)
    for split, prompts in (("train", train), ("eval", held_out)):
        assert len({p.text for p in prompts}) == len({p.prompt_id for p in prompts}) == len(prompts)
        assert all(p.prompt_id.startswith(f"{split}-") for p in prompts)
        assert all(is_held_out(p.text) == (split == "eval") for p in prompts)
    ids = {p.text: p.prompt_id for p in env.prompts("train", 2000, seed=8)}
    assert all(ids.get(p.text, p.prompt_id) == p.prompt_id for p in train)


def test_prompts_large_space_and_too_many():
    env = AdditionEnv(digits=3)  # 810,000 problems: sampled, not listed
    train, held_out = env.prompts("train", 300, seed=1), env.prompts("eval", 100, seed=1)
    assert train == env.prompts("train", 300, seed=1)
    assert len({p.text for p in train}) == 300
    assert not {p.text for p in train} & {p.text for p in held_out}
    with pytest.raises(ValueError, match="found"):
        AdditionEnv(digits=1).prompts("train", 101, seed=0)


@pytest.mark.parametrize("name", ENVS)
def test_texts_in_vocabulary(name, tokenizer):
    env = ENVS[name]()
    for prompt in env.prompts("train", 300, seed=3) + env.prompts("eval", 100, seed=3):
        texts = [prompt.text, prompt.answer] + [s.text for s in env.demonstration(prompt)]
        assert all(UNK_ID not in tokenizer.encode(text) for text in texts), texts


@pytest.mark.parametrize("name", ENVS)
def test_demonstration_plays_through(name, tokenizer):
    env = ENVS[name]()
    for prompt in env.prompts("train", 100, seed=5) + env.prompts("eval", 100, seed=5):
        segments = ENVS[name]().demonstration(prompt)
        model_turns = [s.text for s in segments if s.from_model]
        assert model_turns[-1].endswith(" <eos>")
        assert all(turn.endswith(" <eot>") for turn in model_turns[:-1])
        result, observations = play(ENVS[name](), prompt, segments, tokenizer)
        assert result.done and result.reward == 1.0 and result.info["correct"]
        assert observations == [s.text for s in segments if not s.from_model]


@pytest.mark.parametrize("name", ENVS)
def test_demonstration_fits_tiny_context(name, tokenizer):
    env = ENVS[name]()  # all-ops samples include 4-digit products, the longest episodes
    for prompt in env.prompts("train", 1000, seed=0) + env.prompts("eval", 200, seed=0):
        texts = [prompt.text] + [s.text for s in env.demonstration(prompt)]
        assert 1 + sum(len(tokenizer.encode(text)) for text in texts) < 40


def test_calculator_malformed_calls_cost_a_penalty():
    env = CalculatorEnv(max_turns=3)
    env.reset(CALC_PROMPT)
    assert env.step("CALC 3 +") == StepResult("ERROR <eot>", 0.0, False, {"malformed": True})
    assert env.step("CALC 1 2 - 2 4").observation == "RESULT - 1 2 <eot>"  # the tool computes it
    result = env.step("ANSWER 8 2")
    assert result.done and result.reward == pytest.approx(0.9)
    assert result.info == {"malformed": False, "correct": True, "malformed_calls": 1, "turns": 3,
                           "end": "answer"}
    env = CalculatorEnv(max_turns=2)
    env.reset(CALC_PROMPT)
    assert env.step("CALC " + "9 " * 19 + "* 9").observation == "ERROR <eot>"  # over 18 digits
    result = env.step("garbage")
    assert result.done and result.reward == pytest.approx(-0.2)
    assert result.info["end"] == "max_turns" and result.info["malformed_calls"] == 2


@pytest.mark.parametrize(
    ("actions", "reward", "end"),
    [(["ANSWER 8 2"], 1.0, "answer"),  # no CALC needed
     (["ANSWER 8 3"], 0.0, "answer"),
     (["  "], 0.0, "empty"),
     (["CALC 3 7 + 4 5", "CALC 3 7 + 4 5", "CALC 3 7 + 4 5"], 0.0, "max_turns")],
)
def test_calculator_episode_ends(actions, reward, end):
    env = CalculatorEnv(max_turns=3)
    env.reset(CALC_PROMPT)
    results = [env.step(action) for action in actions]
    assert [r.done for r in results] == [False] * (len(actions) - 1) + [True]
    assert results[-1].reward == reward and results[-1].info["end"] == end
    with pytest.raises(RuntimeError):
        env.step("ANSWER 8 2")


BAD_ACTIONS = ["", "CALC", "CALC 3 7 +", "CALC x y", "CALC - 5 + 3", "CALC ٣ + 4", "ANSWER",
               "9" * 100_000, "CALC " + "3 " * 50_000 + "+ 4", "ÄÖ✓ 日本 \x00", "<eot>",
               "RESULT 8 2"]


@pytest.mark.parametrize("action", BAD_ACTIONS, ids=range(len(BAD_ACTIONS)))
def test_bad_actions_get_zero_or_penalty(action):
    env = CalculatorEnv()
    env.reset(CALC_PROMPT)
    result = env.step(action)
    assert result.reward == 0.0 and (result.done or result.observation == "ERROR <eot>")
    final = result if result.done else env.step(action)
    assert final.done and final.reward in (0.0, pytest.approx(-0.1), pytest.approx(-0.2))
    addition = AdditionEnv()
    addition.reset(ADDITION_PROMPT)
    assert addition.step(action).reward == 0.0


WORDS = TASK_VOCABULARY + ["x", "٣", "9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9"]
ACTIONS = st.one_of(st.text(), st.lists(st.sampled_from(WORDS), max_size=12).map(" ".join))


@settings(max_examples=300, deadline=None)
@given(actions=st.lists(ACTIONS, min_size=4, max_size=4), max_turns=st.integers(1, 4))
def test_step_never_raises(actions, max_turns):
    calculator = CalculatorEnv(max_turns=max_turns, ops=["+", "-", "*"])
    for env in (calculator, AdditionEnv(partial_credit=True)):
        env.reset(Prompt("p", "Q 3 7 - 4 5", "- 8") if env is calculator else ADDITION_PROMPT)
        for action in actions:
            result = env.step(action)
            assert -max_turns * 0.1 - 1e-9 <= result.reward <= 1.0
            if result.done:
                break
            assert result.reward == 0.0 and result.observation.endswith(" <eot>")
        assert result.done


CREDITS = [("8 2", 1.0), (" 8  2 ", 1.0), ("8 3", 0.5), ("1 2", 0.5), ("2", 0.5), ("8 2 2", 1 / 3),
           ("RESULT 8 2", 2 / 3), ("x", 0.0), ("", 0.0)]


@pytest.mark.parametrize(("action", "credit"), CREDITS)
def test_addition_partial_credit(action, credit):
    for partial, expected in ((True, credit), (False, float(credit == 1.0))):
        env = AdditionEnv(partial_credit=partial)
        env.reset(ADDITION_PROMPT)
        result = env.step(action)
        assert result.done and result.reward == pytest.approx(expected)
        assert result.info["correct"] == (credit == 1.0)


def test_load_environment():
    cls = load_environment("tests.test_envs:EchoEnv")
    env = cls(max_turns=1, suffix="!")
    prompt = env.prompts("train", 1, seed=0)[0]
    assert env.reset(prompt) == "train 0!" and env.step("train 0").reward == 1.0
    assert load_environment("tasks.envs.calculator:CalculatorEnv") is CalculatorEnv
    assert load_environment("tasks.envs.arithmetic:AdditionEnv") is AdditionEnv
    for entrypoint, problem in [
        ("no_colon", "must look like"),
        ("tasks.envs.nope:Env", "cannot import"),
        ("tasks.envs.base:Missing", "does not exist"),
        ("tasks.envs.base:Prompt", "not an Environment subclass"),
        ("tests.test_envs:not_a_class", "not an Environment subclass"),
        ("tasks.envs.base:Environment", "does not implement"),
    ]:
        pattern = re.escape(repr(entrypoint)) + ".*" + problem
        with pytest.raises(EnvironmentLoadError, match=pattern):
            load_environment(entrypoint)


def test_load_prompts_jsonl():
    data = b'{"text": "Q 1 + 2", "answer": "3", "prompt_id": "mine"}\n\n'
    data += b'{"text": "Q 2 + 2", "answer": "4", "extra": 1}\n'
    prompts = load_prompts(data, "jsonl")
    assert prompts[0].prompt_id == "mine" and prompts[1].answer == "4"
    assert re.fullmatch(r"p-[0-9a-f]{12}", prompts[1].prompt_id)
    assert load_prompts(data, "jsonl") == prompts  # the default id is stable
    bad_lines = [
        b"{oops", b'{"text": "Q 1"}', b"[1, 2]", b"\xff\xfe", b'{"text": " ", "answer": "1"}',
        b'{"text": "a", "answer": 1}', b'{"text": "a", "answer": "1", "prompt_id": 7}']
    for bad in bad_lines:
        with pytest.raises(ValueError, match="^line 4:"):
            load_prompts(data + bad + b"\n", "jsonl")


def test_load_prompts_parquet():
    def parquet(columns: dict) -> bytes:
        buffer = io.BytesIO()
        pq.write_table(pa.table(columns), buffer)
        return buffer.getvalue()

    plain = {"text": ["Q 1 + 2", "Q 2 + 2"], "answer": ["3", "4"]}
    prompts = load_prompts(parquet(plain), "parquet")
    assert [p.answer for p in prompts] == ["3", "4"] and prompts[0].prompt_id.startswith("p-")
    with_ids = {"prompt_id": ["a", "b"], "text": ["x", "y"], "answer": ["1", "2"]}
    assert [p.prompt_id for p in load_prompts(parquet(with_ids), "parquet")] == ["a", "b"]
    with pytest.raises(ValueError, match="^row 1:"):
        load_prompts(parquet({"text": ["x", "y"], "answer": ["1", None]}), "parquet")
    with pytest.raises(ValueError, match="Parquet"):
        load_prompts(b"not parquet at all", "parquet")
    with pytest.raises(ValueError, match="format"):
        load_prompts(b"", "csv")


def test_split_prompts():
    prompts = [Prompt(f"p{i}", f"Q {i}", str(i)) for i in range(1000)]
    train, held_out = split_prompts(prompts, 0.2, seed=1)
    assert sorted(train + held_out, key=lambda p: int(p.prompt_id[1:])) == prompts
    assert 120 < len(held_out) < 280
    assert (train, held_out) == split_prompts(prompts, 0.2, seed=1)
    train2, held_out2 = split_prompts(prompts, 0.2, seed=2)
    assert set(held_out2) == set(held_out) and train2 != train  # the seed shuffles, never moves
    assert set(split_prompts(prompts, 0.3, seed=1)[1]) >= set(held_out)


def test_calculator_partial_credit_counts_answer_digits_and_keeps_the_penalty():
    env = CalculatorEnv(max_turns=3, partial_credit=True, malformed_penalty=0.1)
    prompt = Prompt("p", "Q 3 7 + 4 5", "8 2")
    env.reset(prompt)
    assert env.step("CALC 3 7 +").observation == "ERROR <eot>"
    assert env.step("ANSWER 9 2").reward == pytest.approx(0.5 - 0.1)
    env.reset(prompt)
    assert env.step("ANSWER 8 2").reward == 1.0
    env.reset(prompt)
    assert env.step("ANSWER 9 2").reward == pytest.approx(0.5)
    strict = CalculatorEnv(partial_credit=False)
    strict.reset(prompt)
    assert strict.step("ANSWER 9 2").reward == 0.0


@pytest.mark.parametrize("env", [AdditionEnv(digits=1), CalculatorEnv(digits=1, ops=["+", "-", "*"])], ids=["addition", "calculator"])
def test_a_held_out_problem_is_not_trained_on_with_its_operands_swapped(env):
    """Split by text, "5 4 + 6 4 =" was held out and "6 4 + 5 4 =" trained on: 155 of 200
    held-out addition prompts had their twin in training. Subtraction's swapped twin is another
    problem. The training prompts are the same as before (chosen by their own text)."""
    def problem(text: str) -> tuple:
        words = text.removeprefix("Q ").removesuffix(" =").split()
        at = next(i for i, w in enumerate(words) if w in "+-*" and i > 0)
        left, right = "".join(words[:at]), "".join(words[at + 1 :])
        return (words[at], *sorted((left, right))) if words[at] in "+*" else (words[at], left, right)

    evaluated = {problem(p.text) for p in every_prompt(env, "eval")}
    trained = {problem(p.text) for p in every_prompt(env, "train")}
    assert evaluated and trained and not evaluated & trained


def every_prompt(env, split: str) -> list:
    """Every prompt of `split` in the environment's problem space."""
    with pytest.raises(ValueError, match=r"found \d+ distinct") as too_many:
        env.prompts(split, 10_000, 0)
    return env.prompts(split, int(re.search(r"found (\d+)", str(too_many.value))[1]), 0)


def readme_block(language: str, after: str) -> str:
    """The first ```language block of README.md after the line `after`."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    return text.split(after, 1)[1].split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_the_readmes_own_environment_trains_on_a_jsonl_file_as_configured(tmp_path):
    """The README's example is code a user copies: it must import, split and score as it says,
    and its YAML must be a valid env section."""
    namespace: dict = {}
    exec(compile(readme_block("python", "<!-- tested: tests/test_envs.py runs this block -->"), "README.md", "exec"), namespace)
    rows = [{"text": f"what is {i} + {i}?", "answer": str(2 * i)} for i in range(200)]
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows))
    env_section = yaml.safe_load(readme_block("yaml", "<!-- tested: tests/test_envs.py runs this block -->"))["env"]
    env_section["kwargs"]["path"] = str(data)
    config = EnvConfig.model_validate(env_section)
    env = namespace["QAEnv"](max_turns=config.max_turns, **config.kwargs)
    train, held_out = env.prompts("train", 150, seed=1), env.prompts("eval", 10, seed=1)
    assert not {p.text for p in train} & {p.text for p in held_out}
    with pytest.raises(ValueError, match="has 1.. train prompts, 5000 asked for"):
        env.prompts("train", config.train_prompts, seed=1)
    env.reset(train[0])
    assert env.step(f" {train[0].answer}\n").reward == 1.0
    env.reset(train[0])
    assert env.step("no idea").reward == 0.0
