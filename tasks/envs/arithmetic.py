"""Single-turn addition, the smallest verifiable task, and the number helpers tasks share.

Prompt "3 7 + 4 5 =" (two numbers of `digits` digits; numbers are written digit by digit because
the tokenizer splits on whitespace only), ideal completion "8 2 <eos>". One step, then done.
Reward: 1.0 for an exact match, else 0.0; with `partial_credit`, the share of answer digits right
in their place value (aligned from the units digit), over the longer of the two lengths, so extra
or missing digits cost credit and only the exact answer scores 1.0.
"""

from __future__ import annotations

from tasks.envs.base import Environment, Prompt, Segment, Split, StepResult, sample_prompts

DIGITS = frozenset("0123456789")
MAX_DIGITS = 18


def spell(number: int) -> str:
    """An integer as the tokenizer's words: 82 -> "8 2", -12 -> "- 1 2"."""
    sign = ["-"] if number < 0 else []
    return " ".join(sign + list(str(abs(number))))


def operand_range(digits: int) -> range:
    """The numbers of exactly `digits` digits (0-9 for one digit)."""
    if not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"digits must be in 1..{MAX_DIGITS}, got {digits}")
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def answer_reward(guess: list[str], answer: list[str], partial_credit: bool) -> float:
    """1.0 for the exact answer; else, with partial credit, the share of digits right counted
    from the units digit (a dense signal: each right digit is worth something), otherwise 0."""
    if guess == answer:
        return 1.0
    if not partial_credit or not guess:
        return 0.0
    right = sum(g == a for g, a in zip(reversed(guess), reversed(answer)))
    return right / max(len(guess), len(answer))


class AdditionEnv(Environment):
    """Add two numbers in one turn. kwargs: digits per number (2), partial_credit (False)."""

    def __init__(self, max_turns: int = 1, digits: int = 2, partial_credit: bool = False) -> None:
        super().__init__(max_turns)
        self.operands = operand_range(digits)
        self.partial_credit = partial_credit
        self.prompt: Prompt | None = None

    def _render(self, index: int) -> tuple[str, str]:
        a, b = divmod(index, len(self.operands))
        a, b = self.operands[a], self.operands[b]
        return f"{spell(a)} + {spell(b)} =", spell(a + b)

    def _twins(self, index: int) -> list[int]:
        """b + a for a + b: the same problem."""
        a, b = divmod(index, len(self.operands))
        return [b * len(self.operands) + a]

    def prompts(self, split: Split, count: int, seed: int) -> list[Prompt]:
        return sample_prompts(split, count, seed, len(self.operands) ** 2, self._render, self._twins)

    def reset(self, prompt: Prompt) -> str:
        self.prompt = prompt
        return prompt.text

    def step(self, action: str) -> StepResult:
        if self.prompt is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        answer, self.prompt = self.prompt.answer.split(), None
        guess = action.split()
        correct = guess == answer
        reward = answer_reward(guess, answer, self.partial_credit)
        malformed = not guess or not all(token in DIGITS for token in guess)
        return StepResult("", reward, True, {"correct": correct, "malformed": malformed})

    def demonstration(self, prompt: Prompt) -> list[Segment]:
        return [Segment(f"{prompt.answer} <eos>", from_model=True)]
