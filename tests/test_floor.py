"""The scaling benchmark's zero-overhead model (benchmarks/floor.py): it must reproduce the ideal
where nothing but the profile's own times limits a step, and charge the lag window where it binds.
Pure computation on seeded draws: no servers, no timings of this machine."""

from __future__ import annotations

import pytest

from benchmarks.floor import floor_seconds, publish_times
from benchmarks.scaling import BATCH, MAX_NEW_TOKENS, PROFILES, PROMPT_TOKENS, RUNNING_CAP, latency_for

SNAPSHOT_BYTES = 2_130_000
"""About the tiny model's safetensors; it only scales the engines' load time to S."""


def floor(profile: str, engines: int, max_lag: int, **overrides) -> float:
    p = PROFILES[profile]
    t, s = overrides.get("t", p.t), overrides.get("s", p.s)
    return floor_seconds(latency_for(p, SNAPSHOT_BYTES), engines, max_lag, t, s, BATCH, RUNNING_CAP, MAX_NEW_TOKENS, PROMPT_TOKENS)


def test_a_synchronous_step_on_one_engine_is_g1_plus_t_plus_s():
    """One engine, nothing in flight across versions: generate a batch (G1, what the latency model
    is calibrated to), train (T), load (S)."""
    p = PROFILES["seed"]
    assert floor("seed", 1, 0) == pytest.approx(p.g1 + p.t + p.s, rel=0.02)


def test_a_trainer_bound_async_run_steps_at_t():
    """Slime's profile from 2 engines on: generation hides behind training, and the trainer, which
    publishes without waiting for the engines' load, steps at T."""
    assert floor("seed", 3, 2) == pytest.approx(PROFILES["seed"].t, rel=0.01)


def test_a_generation_bound_async_run_pays_the_engines_load_and_then_the_lag_window():
    """The generation-heavy profile at 4 engines: with max_lag 3 the engines bound the step at
    G1/N + S (every engine stops for S at every version); with max_lag 2 three batches in flight
    cannot cover one batch's latency, and the step is longer still."""
    p = PROFILES["agentic"]
    generation = p.g1 / 4 + p.s
    assert floor("agentic", 4, 3) == pytest.approx(generation, rel=0.02)
    assert floor("agentic", 4, 2) > 1.03 * generation
    assert floor("agentic", 4, 3, s=0.0) == pytest.approx(p.g1 / 4, rel=0.02)


def test_more_engines_or_a_wider_window_never_slow_a_step():
    for engines in (1, 2, 3):
        assert floor("agentic", engines + 1, 2) < floor("agentic", engines, 2)
    for lag in (0, 1, 2):
        assert floor("agentic", 4, lag + 1) <= floor("agentic", 4, lag) + 0.01


def test_versions_are_published_in_order_and_the_draws_are_seeded():
    p = PROFILES["agentic"]
    args = (latency_for(p, SNAPSHOT_BYTES), 2, 2, p.t, p.s, BATCH, RUNNING_CAP, MAX_NEW_TOKENS, PROMPT_TOKENS, 20)
    times = publish_times(*args, seed=1)
    assert len(times) == 20 and all(b > a for a, b in zip(times, times[1:]))
    assert publish_times(*args, seed=1) == times and publish_times(*args, seed=2) != times
