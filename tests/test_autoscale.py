"""The autoscale policy: one step at a time towards a trainer that does not wait."""

from __future__ import annotations

from configs.sections import AutoscaleConfig
from tasks.autoscale import autoscale_target, generator_wait_fraction, trainer_idle_fraction

POLICY = AutoscaleConfig(min=1, max=3, target_trainer_idle=0.2, max_generator_wait=0.3)


def steps(wait: float, step: float, count: int = 12, at: float = 100.0) -> list[dict]:
    return [{"event": "train_step", "time": at, "wait_seconds": wait, "step_seconds": step}] * count


def test_trainer_idle_fraction_is_over_the_last_ten_steps():
    assert trainer_idle_fraction([]) is None
    records = steps(wait=9.0, step=1.0, count=5) + steps(wait=1.0, step=3.0, count=10)
    assert trainer_idle_fraction(records) == 0.25


def test_trainer_idle_fraction_counts_only_steps_after_the_last_change():
    """A step slower than the cooldown: the measurement from before a change does not decide the
    next one; two steps after it do."""
    before = steps(wait=9.0, step=1.0, count=10, at=50.0)
    assert trainer_idle_fraction(before, since=60.0) is None
    assert trainer_idle_fraction(before + steps(wait=1.0, step=3.0, count=1, at=70.0), since=60.0) is None
    assert trainer_idle_fraction(before + steps(wait=1.0, step=3.0, count=2, at=70.0), since=60.0) == 0.25
    begun_before = steps(wait=9.0, step=1.0, count=1, at=65.0)  # ended after the change, began before it
    assert trainer_idle_fraction(begun_before + steps(wait=1.0, step=3.0, count=1, at=70.0), since=60.0) is None


def test_generator_wait_takes_each_generators_newest_report_since_the_last_change():
    gen0 = [{"event": "load", "time": 10.0, "idle_fraction": 0.9}, {"event": "load", "time": 20.0, "idle_fraction": 0.4}]
    gen1 = [{"event": "load", "time": 5.0, "idle_fraction": 1.0}]
    assert generator_wait_fraction([gen0, gen1], since=8.0) == 0.4
    assert generator_wait_fraction([gen0, gen1], since=0.0) == 0.7
    assert generator_wait_fraction([gen1], since=8.0) is None


def test_a_waiting_trainer_gets_one_more_generator_up_to_max():
    assert autoscale_target(1, trainer_idle=0.5, generator_wait=None, policy=POLICY) == 2
    assert autoscale_target(3, trainer_idle=0.5, generator_wait=0.0, policy=POLICY) == 3
    assert autoscale_target(1, trainer_idle=0.5, generator_wait=0.9, policy=POLICY) == 2, "a waiting trainer wins"


def test_generators_held_back_by_the_lag_bound_lose_one_down_to_min():
    assert autoscale_target(3, trainer_idle=0.05, generator_wait=0.6, policy=POLICY) == 2
    assert autoscale_target(1, trainer_idle=0.05, generator_wait=0.6, policy=POLICY) == 1


def test_a_generator_is_retired_only_if_the_others_could_do_its_work_and_still_wait():
    """A run that needs 1.3 generators' work: two wait 35% each, past max_generator_wait (0.3),
    but one alone cannot feed the trainer, which then waits and gets its second back: a boot each
    cycle, for good, before the retire asked whether the rest could carry the load."""
    assert autoscale_target(2, trainer_idle=0.05, generator_wait=0.35, policy=POLICY) == 2
    assert autoscale_target(2, trainer_idle=0.05, generator_wait=0.65, policy=POLICY) == 1, "0.7 generators' work: one does it"
    assert autoscale_target(1, trainer_idle=0.3, generator_wait=None, policy=POLICY) == 2, "and the way back"


def test_no_generator_is_retired_before_the_trainer_s_idle_fraction_is_measured_again():
    """A step of 100 s, max_lag 0: the trainer idles 60% while generators wait 40% of each 10 s
    window. Retiring on the generators' wait alone while the trainer's signal was still unknown
    after an addition undid it, and the next measurement added it again."""
    assert autoscale_target(1, trainer_idle=0.6, generator_wait=0.4, policy=POLICY) == 2
    assert autoscale_target(2, trainer_idle=None, generator_wait=0.6, policy=POLICY) == 2


def test_a_balanced_run_keeps_its_size_and_bounds_are_enforced_first():
    assert autoscale_target(2, trainer_idle=0.1, generator_wait=0.1, policy=POLICY) == 2
    assert autoscale_target(2, trainer_idle=None, generator_wait=None, policy=POLICY) == 2
    assert autoscale_target(5, trainer_idle=0.9, generator_wait=None, policy=POLICY) == 3
    assert autoscale_target(0, trainer_idle=None, generator_wait=None, policy=POLICY) == 1


def test_records_without_durations_count_as_begun_at_their_end():
    """A run continued from records written before steps carried their durations."""
    old = [{"event": "train_step", "time": 50.0}] * 3
    assert trainer_idle_fraction(old + steps(wait=1.0, step=3.0, count=2, at=70.0), since=60.0) == 0.25
