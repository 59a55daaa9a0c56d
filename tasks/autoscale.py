"""How many generation runs a run should have, from what its components measure.

The deployed parent (flows/supervisor.py) asks `autoscale_target` every few seconds. Two signals,
both read from the run's metrics files, so the decision needs nothing but the run directory:

- the trainer's idle fraction over its last steps (`wait_seconds` against `step_seconds`): above
  `target_trainer_idle`, the trainer waits for data, so generation is the bottleneck: add one;
- the generators' admission wait (their `load` records: the share of time a generator had
  nothing it was allowed to start): above `max_generator_wait`, generators are held back by the
  lag bound: retire one, if the others could do its work and still wait that much. N generators
  busy (1 - wait) of the time do N x (1 - wait) generators' work; retired on the wait alone, a
  run that needs 1.3 generators' work went 2 -> 1 (each of two waits 35%) and 1 -> 2 (one
  cannot keep the trainer fed) for good, an engine's boot each cycle.

One step at a time, and no change within `cooldown_seconds` of the last, so that each change
shows in the measurements before the next is decided. Adding wins when both signals fire: a
trainer that waits is the cost tandem exists to remove. So a retire waits until the trainer's
idle fraction is measured again after the last change: decided on the generators' wait alone (a
10 s window, high whenever it falls while the trainer steps), it retired the generator just
added for a waiting trainer, which the next measurement added again, a boot each cycle.
"""

from __future__ import annotations

from configs.sections import AutoscaleConfig

RECENT_STEPS = 10
"""Trainer steps the idle fraction is measured over."""
STEPS_AFTER_A_CHANGE = 2
"""Trainer steps begun after a change before the trainer's idle fraction counts again (a new
generator boots during the first)."""


def trainer_idle_fraction(trainer_records: list[dict], since: float = 0.0) -> float | None:
    """Idle share of the trainer's last `RECENT_STEPS` steps after `since` (the last change);
    None before `STEPS_AFTER_A_CHANGE` of them. Steps from before the change say nothing of it:
    counted, a trainer whose step outlasts the cooldown added a generator at every cooldown on
    the same measurement, up to the maximum, before the first addition could show."""
    steps = [r for r in trainer_records if r.get("event") == "train_step" and _began(r) >= since][-RECENT_STEPS:]
    if len(steps) < STEPS_AFTER_A_CHANGE:
        return None
    busy = sum(r.get("step_seconds", 0.0) for r in steps)
    idle = sum(r.get("wait_seconds", 0.0) for r in steps)
    return idle / (busy + idle) if busy + idle > 0 else None


def _began(step: dict) -> float:
    """When a step's wait for data began: its record is written at its end. (Records from before
    they carried their durations count as begun at their end, long before any change now.)"""
    return step["time"] - step.get("step_seconds", 0.0) - step.get("wait_seconds", 0.0)


def generator_wait_fraction(generator_records: list[list[dict]], since: float) -> float | None:
    """Mean admission-wait share of each generator's newest `load` record after `since`."""
    latest = [max((r for r in records if r.get("event") == "load" and r["time"] >= since), key=lambda r: r["time"], default=None)
              for records in generator_records]  # fmt: skip
    shares = [r["idle_fraction"] for r in latest if r is not None]
    return sum(shares) / len(shares) if shares else None


def autoscale_target(current: int, trainer_idle: float | None, generator_wait: float | None, policy: AutoscaleConfig) -> int:
    """The number of generation runs to have next: `current` moved by at most one, within bounds."""
    target = policy.bounded(current)
    if target != current:
        return target
    if trainer_idle is not None and trainer_idle > policy.target_trainer_idle:
        return min(current + 1, policy.max)
    if trainer_idle is not None and generator_wait is not None and generator_wait > policy.max_generator_wait:
        if current * (1 - generator_wait) <= (current - 1) * (1 - policy.max_generator_wait):
            return max(current - 1, policy.min)
    return current
