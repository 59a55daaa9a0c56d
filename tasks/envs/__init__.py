"""Environments: the tasks an agent is trained on, as text-in, text-out episodes.

- base.py: the contract (`Environment`, one instance per episode, with `prompts`, `reset`, `step`,
  `truncate` and, for the warm-start, `demonstration`; `Prompt`, `StepResult`, `Segment`), the hash-based train/eval
  split, the entrypoint loader (`load_environment`, and `environment_factory` over it) and prompt
  files from storage (`load_prompts`, `split_prompts`).
- arithmetic.py: `AdditionEnv`, single-turn addition with an exact-match or partial-credit reward.
- calculator.py: `CalculatorEnv`, a two-turn tool task: call "CALC a op b", read "RESULT ...",
  then "ANSWER ...".

Built-ins are loaded by entrypoint ("tasks.envs.calculator:CalculatorEnv"), like user classes.
Domain logic only: no Prefect, no HTTP, no torch.
"""

from tasks.envs.base import (
    Environment,
    EnvironmentLoadError,
    Prompt,
    Segment,
    StepResult,
    environment_factory,
    has_demonstrations,
    load_environment,
    load_prompts,
    split_prompts,
)

__all__ = [
    "Environment",
    "EnvironmentLoadError",
    "Prompt",
    "Segment",
    "StepResult",
    "environment_factory",
    "has_demonstrations",
    "load_environment",
    "load_prompts",
    "split_prompts",
]
