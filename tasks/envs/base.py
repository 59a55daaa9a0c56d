"""The environment contract of the RL loop, and the helpers every environment shares.

- `Environment`: a Gym-like episode, one instance per episode: the rollout builds a fresh one with
  `cls(max_turns=cfg.max_turns, **cfg.kwargs)`, calls `reset(prompt)`, then alternates model turn
  and `step(action)` until done, or `truncate()` when it cuts the episode short. Text in, text out (`Prompt`, `StepResult`, `Segment`): the
  rollout owns tokens.
- `sample_prompts`, `is_held_out`: deterministic procedural prompts whose train/eval split is
  decided by a hash of the prompt text alone, a problem held out only if each of its texts is
  (a + b and b + a), so a held-out problem is never drawn for training, whatever the seeds and
  counts.
- `load_environment`: "package.module:Class" -> the class, with errors that name the entrypoint.
- `load_prompts`, `split_prompts`: prompt files from storage (JSONL or Parquet) and their split.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

Split = Literal["train", "eval"]
Render = Callable[[int], tuple[str, str]]  # problem index -> (prompt text, answer text)
HELD_OUT_FRACTION = 0.2
"""Share of a procedural task's problem space that is held out for evaluation."""
_ENUMERATE_LIMIT = 200_000  # problem spaces up to this size are listed exactly, larger ones sampled


@dataclass(frozen=True)
class Prompt:
    """One problem: `text` is the initial observation, `answer` the reference answer text."""
    prompt_id: str
    text: str
    answer: str


@dataclass(frozen=True)
class Segment:
    """A piece of an episode's text, special tokens included, written by the model or not."""
    text: str
    from_model: bool


@dataclass
class StepResult:
    """What `step` returns. `observation` is appended to the context as-is ("" when done). The
    episode's reward is the sum of its steps' rewards (and `truncate`'s, when the rollout cuts it
    short): a task may pay as it goes, or only at its last step. A reward is a finite number.
    `info` is the environment's own (its tests, its debugging): tandem does not record it."""
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode of a task. Subclasses add their own keyword arguments (the config's kwargs)."""

    def __init__(self, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns

    @abstractmethod
    def prompts(self, split: Split, count: int, seed: int) -> list[Prompt]:
        """`count` prompts of `split`, the same for the same seed; train and eval never overlap."""

    @abstractmethod
    def reset(self, prompt: Prompt) -> str:
        """Start the episode on `prompt`; returns the initial observation (usually prompt.text)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Play one model turn. `action` is the turn decoded without the stop token that closed
        it (<eot>/<eos>); any other special token in it is left in as text. Which of them closed
        it is not passed (a chat model ends every turn on the same one): whether the episode
        ends is the action text's to say, as "ANSWER ..." does in CalculatorEnv. The observation is tool text that ends with "<eot>" so
        the model sees a turn boundary; the rollout tokenizes it as-is. Never raises on any
        action text; raises RuntimeError when called before reset or after done. The rollout
        calls it in a thread of its own (so it may block on a tool: a subprocess, an HTTP call),
        one call of an episode at a time; one that raises or outlasts env.step_timeout_s fails
        its group (tasks/rollout.py `EnvironmentFailed`)."""

    def truncate(self) -> StepResult:
        """End an episode the rollout cut short: the context is full, or the last allowed turn
        did not end it. Its reward is added to the steps' so far: together, what this task pays an
        episode with no answer, the same as one that ran out of turns, or it pays to fill the
        context instead (0.0 here; a task with penalties charges them). Never raises."""
        return StepResult("", 0.0, True, {"end": "truncated"})

    def demonstration(self, prompt: Prompt) -> list[Segment]:
        """The ideal episode after the prompt, exactly as the rollout would record it for a
        perfect model: model turns end with <eot> (more to come) or <eos> (the last), and the
        env segments equal the observations `step` returns. Used by the supervised warm-start,
        which encodes the text as it is: <eot> and <eos> are the tiny tokenizer's end tokens; for
        another model, write its own (Qwen's <|im_end|>), or the warm-start teaches the model to
        write the characters "<eos>". Only a run with training.warmup_steps > 0 asks for it (a
        pretrained model's default is 0); one without it is refused as it starts."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstration: set training.warmup_steps: 0")


def has_demonstrations(env_cls: type[Environment]) -> bool:
    """Whether `env_cls` gives the warm-start's demonstrations (overrides `demonstration`)."""
    return env_cls.demonstration is not Environment.demonstration


def is_held_out(text: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    """True when `text` falls in the eval split: its sha256, read as a number in [0, 1), is below
    `fraction`. Seed-free, so a text's split never changes; raising `fraction` only adds texts."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def sample_prompts(
    split: Split, count: int, seed: int, space: int, render: Render, twins: Callable[[int], list[int]] | None = None,
) -> list[Prompt]:  # fmt: skip
    """`count` distinct problems of `split` from a space of `space` problems, where `render(i)`
    gives problem i's (text, answer). The id is f"{split}-{i:06d}", stable across seeds and
    counts. Raises ValueError when the split has fewer than `count` problems.

    `twins(i)`: the other indices that pose problem i's problem in another text (b + a for a + b).
    A problem is held out only if every text of it is: by text alone, 155 of 200 held-out
    addition prompts had their operands-swapped twin among the training prompts. Training
    prompts are still chosen by their own text, so a run's training prompts stay as they were;
    a text held out whose twin is not is in neither split."""
    twins = twins or (lambda i: [])

    def in_split(i: int) -> bool:
        if not held_out:
            return not is_held_out(render(i)[0])
        return is_held_out(render(i)[0]) and all(is_held_out(render(j)[0]) for j in twins(i))

    if split not in ("train", "eval") or count < 0:
        raise ValueError(f"need split 'train' or 'eval' and count >= 0, got {split!r}, {count}")
    held_out = split == "eval"
    rng = random.Random(seed)
    chosen: dict[int, None] = {}  # an insertion-ordered set
    if space <= _ENUMERATE_LIMIT:
        pool = [i for i in range(space) if in_split(i)]
        chosen = dict.fromkeys(rng.sample(pool, min(count, len(pool))))
    else:
        for _ in range(100 * count + 10_000):
            if len(chosen) == count:
                break
            i = rng.randrange(space)
            if i not in chosen and in_split(i):
                chosen[i] = None
    if len(chosen) < count:
        raise ValueError(f"asked for {count} {split} prompts, found {len(chosen)} distinct ones")
    return [Prompt(f"{split}-{i:06d}", *render(i)) for i in chosen]


class EnvironmentLoadError(ImportError):
    """An environment entrypoint that cannot be imported or is not an Environment class."""


def load_environment(entrypoint: str) -> type[Environment]:
    """Import "package.module:Class" and check that it is a concrete Environment subclass."""
    module_name, sep, class_name = entrypoint.partition(":")
    where = f"environment entrypoint {entrypoint!r}"
    if not (sep and module_name and class_name):
        raise EnvironmentLoadError(f"{where} must look like 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the module's own import errors too, named for the user
        raise EnvironmentLoadError(f"{where}: cannot import {module_name!r}: {error!r}") from error
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        problem = "does not exist" if cls is None else f"is {cls!r}, not an Environment subclass"
        raise EnvironmentLoadError(f"{where}: {module_name}.{class_name} {problem}")
    if cls.__abstractmethods__:
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise EnvironmentLoadError(f"{where}: {class_name} does not implement {missing}")
    return cls


def environment_factory(entrypoint: str, max_turns: int, kwargs: dict[str, Any]) -> Callable[[], Environment]:
    """What makes one episode's environment: the class `entrypoint` names (`load_environment`,
    imported once), called with `max_turns` and the config's `env.kwargs` at each call. What the
    class refuses of them (a `max_turns` among the kwargs too) is raised by that call, where
    tasks/rundir.py `check_run_inputs` names it as env.kwargs' fault."""
    env_cls = load_environment(entrypoint)
    return lambda: env_cls(max_turns=max_turns, **kwargs)


def load_prompts(data: bytes, fmt: Literal["jsonl", "parquet"]) -> list[Prompt]:
    """Prompts from a file's bytes: JSONL lines or Parquet rows with string fields text, answer and
    optional prompt_id (if missing or empty: "p-" + 12 hex digits of sha256 of text and answer);
    other fields are ignored. Raises ValueError naming the bad JSONL line (1-based) or Parquet row
    (0-based)."""
    if fmt == "jsonl":
        records = []
        for number, line in enumerate(data.split(b"\n"), start=1):
            try:
                if line.strip():
                    records.append((f"line {number}", json.loads(line.decode("utf-8"))))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(f"line {number}: not valid JSON: {error}") from error
    elif fmt == "parquet":
        try:
            rows = pq.read_table(pa.BufferReader(data)).to_pylist()
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"not a readable Parquet file: {error}") from error
        records = [(f"row {number}", row) for number, row in enumerate(rows)]
    else:
        raise ValueError(f"unknown prompt file format {fmt!r}; use 'jsonl' or 'parquet'")
    return [_record_to_prompt(record, where) for where, record in records]


def _record_to_prompt(record: Any, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with text and answer, got {record!r:.80}")
    text, answer = record.get("text"), record.get("answer")
    if not (isinstance(text, str) and text.strip() and isinstance(answer, str)):
        raise ValueError(f"{where}: text (non-empty) and answer must be strings: {record!r:.200}")
    digest = hashlib.sha256(f"{text}\0{answer}".encode("utf-8")).hexdigest()
    prompt_id = record.get("prompt_id") or f"p-{digest[:12]}"
    if not isinstance(prompt_id, str):
        raise ValueError(f"{where}: prompt_id must be a string, got {prompt_id!r:.80}")
    return Prompt(prompt_id, text, answer)


def split_prompts(
    prompts: Sequence[Prompt], eval_fraction: float, seed: int
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval): a prompt is eval when `is_held_out(text, eval_fraction)`, so equal texts
    share a side and the split does not depend on the seed; the seed only shuffles each side."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    sides: tuple[list[Prompt], list[Prompt]] = ([], [])  # indexed by is_held_out: train, eval
    for prompt in prompts:
        sides[is_held_out(prompt.text, eval_fraction)].append(prompt)
    rng = random.Random(seed)
    for side in sides:
        rng.shuffle(side)
    return sides
