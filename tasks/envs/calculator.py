"""Multi-turn tool use: answer an arithmetic question by calling a calculator tool first.

The ideal episode, with the special tokens the rollout records:
    prompt  "Q 3 7 + 4 5"
    model   "CALC 3 7 + 4 5 <eot>"
    tool    "RESULT 8 2 <eot>"          (negative: "RESULT - 1 2 <eot>")
    model   "ANSWER 8 2 <eos>"
The tool accepts exactly "CALC <digits> <op> <digits>" (op one of + - *, at most 18 digits per
number) and computes whatever it is asked, even numbers that differ from the question. Anything
else that is not an ANSWER is a malformed call: observation "ERROR <eot>", a penalty, and the
episode goes on while turns remain. The episode ends on "ANSWER ...", on an empty turn, or after
`max_turns` turns. Reward (all on the last step): 1.0 if the ANSWER equals the true result, else
0.0 (with `partial_credit`, the share of its digits right, as in AdditionEnv), minus
`malformed_penalty` per malformed call; so it lies in [-max_turns * penalty, 1].
An ANSWER without a CALC is allowed. With max_turns 1 the demonstration answers directly.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from tasks.envs.arithmetic import DIGITS, MAX_DIGITS, answer_reward, operand_range, spell
from tasks.envs.base import Environment, Prompt, Segment, Split, StepResult, sample_prompts

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
COMMUTATIVE = frozenset("+*")


def evaluate(tokens: Sequence[str]) -> int | None:
    """The value of "<digits> <op> <digits>" as words, or None if the words are not that."""
    op_at = next((i for i, token in enumerate(tokens) if token in OPERATIONS), None)
    if op_at is None:
        return None
    left, right = tokens[:op_at], tokens[op_at + 1 :]
    for number in (left, right):
        if not 1 <= len(number) <= MAX_DIGITS or not all(token in DIGITS for token in number):
            return None
    return OPERATIONS[tokens[op_at]](int("".join(left)), int("".join(right)))


class CalculatorEnv(Environment):
    """Arithmetic questions answered through a calculator tool.

    kwargs: digits per number (2), ops the questions use (["+"]), malformed_penalty (0.1),
    partial_credit (False)."""

    def __init__(
        self,
        max_turns: int = 2,
        digits: int = 2,
        ops: Sequence[str] = ("+",),
        malformed_penalty: float = 0.1,
        partial_credit: bool = False,
    ) -> None:
        super().__init__(max_turns)
        self.operands = operand_range(digits)
        self.ops = tuple(ops)
        if not self.ops or any(op not in OPERATIONS for op in self.ops):
            raise ValueError(f"ops must be a non-empty list of {sorted(OPERATIONS)}, got {ops!r}")
        if malformed_penalty < 0:
            raise ValueError(f"malformed_penalty must be >= 0, got {malformed_penalty}")
        self.malformed_penalty = malformed_penalty
        self.partial_credit = partial_credit
        self.prompt: Prompt | None = None
        self.turns = 0
        self.malformed = 0

    def _render(self, index: int) -> tuple[str, str]:
        op, pair = divmod(index, len(self.operands) ** 2)
        a, b = divmod(pair, len(self.operands))
        a, b, op = self.operands[a], self.operands[b], self.ops[op]
        return f"Q {spell(a)} {op} {spell(b)}", spell(OPERATIONS[op](a, b))

    def _twins(self, index: int) -> list[int]:
        """b op a for a op b when op is + or *: the same problem."""
        op, pair = divmod(index, len(self.operands) ** 2)
        a, b = divmod(pair, len(self.operands))
        if self.ops[op] not in COMMUTATIVE:
            return []
        return [op * len(self.operands) ** 2 + b * len(self.operands) + a]

    def prompts(self, split: Split, count: int, seed: int) -> list[Prompt]:
        space = len(self.ops) * len(self.operands) ** 2
        return sample_prompts(split, count, seed, space, self._render, self._twins)

    def reset(self, prompt: Prompt) -> str:
        self.prompt, self.turns, self.malformed = prompt, 0, 0
        return prompt.text

    def step(self, action: str) -> StepResult:
        if self.prompt is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        self.turns += 1
        words = action.split()
        if not words:
            return self._end(correct=False, end="empty")
        if words[0] == "ANSWER":
            credit = answer_reward(words[1:], self.prompt.answer.split(), self.partial_credit)
            return self._end(correct=words[1:] == self.prompt.answer.split(), end="answer", credit=credit)
        value = evaluate(words[1:]) if words[0] == "CALC" else None
        if value is None:
            self.malformed += 1
        if self.turns >= self.max_turns:
            return self._end(correct=False, end="max_turns", malformed=value is None)
        observation = "ERROR <eot>" if value is None else f"RESULT {spell(value)} <eot>"
        return StepResult(observation, 0.0, False, {"malformed": value is None})

    def truncate(self) -> StepResult:
        """Cut short (the context full): no answer, and the malformed calls so far charged, as
        when the turns run out."""
        return self._end(correct=False, end="truncated")

    def _end(self, correct: bool, end: str, malformed: bool = False, credit: float = 0.0) -> StepResult:
        """Close the episode: info says this turn's `malformed`, and `correct`, `malformed_calls`,
        `turns` and `end` ("answer", "empty", "max_turns" or "truncated") for the whole episode."""
        self.prompt = None
        reward = max(float(correct), credit) - self.malformed_penalty * self.malformed
        info = {"malformed": malformed, "correct": correct, "malformed_calls": self.malformed}
        return StepResult("", reward, True, info | {"turns": self.turns, "end": end})

    def demonstration(self, prompt: Prompt) -> list[Segment]:
        answer = Segment(f"ANSWER {prompt.answer} <eos>", from_model=True)
        if self.max_turns == 1:
            return [answer]
        words = prompt.text.split()
        value = evaluate(words[1:]) if words[:1] == ["Q"] else None
        if value is None:
            raise ValueError(f"{prompt.prompt_id}: {prompt.text!r} is not 'Q <num> <op> <num>'")
        return [
            Segment(f"CALC {' '.join(words[1:])} <eot>", from_model=True),
            Segment(f"RESULT {spell(value)} <eot>", from_model=False),
            answer,
        ]
