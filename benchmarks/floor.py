"""The step time no implementation can beat on the scaling benchmark's workload: its pipeline
replayed as a discrete-event model with zero overhead.

The model keeps what the lag contract and the engines impose, and none of tandem's own work:

- N engines, each decoding at most `cap` sequences and queueing the rest first come, first
  served; a decode step takes `decode_base_s + decode_s_per_seq * running`, plus the prefill of
  the sequences it admits, as the sim engine's does (infra/engines/sim.py). Every request is one
  sample whose length is drawn from the sim engine's capped lognormal, sent to the engine with
  the fewest outstanding requests, as the engine client sends it; an engine that runs dry takes
  the newer half of the busiest engine's requests with their tokens so far (the client's
  straggler hand-off).
- The lag bound: batch b may start once the engines are on version b - max_lag (max_lag 0 is the
  synchronous loop).
- The trainer trains batch v once every sample of it is done, for T, and publishes v + 1 at that
  instant; every engine then stops for S to load it (after the decode step under way), and the
  batch the bound now admits is queued at once, to run after the load (tandem's start of the
  next batch during the load).

No polling, storage, Prefect or Dask. `floor_seconds` is the mean step over many steps after a
warm-up, the statistic the benchmark measures: tandem's scheduling on this workload with its own
work taken away. The benchmark prints it beside the ideal: a run near its floor loses nothing to
tandem's overhead, and a floor above the ideal is what the lag bound and the engines cost.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from configs.sections import SimLatencyConfig


@dataclass
class _Engine:
    """One engine's state in the model."""

    queue: deque = field(default_factory=deque)
    """[tokens left, batch] of every request sent and not yet running."""
    running: list = field(default_factory=list)
    busy_until: float | None = None
    """When the decode step or load under way ends; None while the engine is idle."""
    load_due: bool = False
    """A snapshot was published: load it once the step under way ends."""
    loading: bool = False
    """The event under way is a load, not a decode step (no sequence advances)."""

    @property
    def outstanding(self) -> int:
        return len(self.queue) + len(self.running)


def floor_seconds(latency: SimLatencyConfig, engines: int, max_lag: int, t: float, s: float, batch: int, cap: int,
                  max_new_tokens: int, prompt_tokens: int, steps: int = 120, warmup: int = 12, seed: int = 0) -> float:  # fmt: skip
    """Mean seconds per training step over `steps` steps after `warmup`, with zero overhead."""
    times = publish_times(latency, engines, max_lag, t, s, batch, cap, max_new_tokens, prompt_tokens, warmup + steps + 1, seed)
    return (times[-1] - times[warmup]) / steps


def publish_times(latency: SimLatencyConfig, engines: int, max_lag: int, t: float, s: float, batch: int, cap: int,
                  max_new_tokens: int, prompt_tokens: int, count: int, seed: int = 0) -> list[float]:  # fmt: skip
    """When the trainer publishes versions 1 to `count`, in the model (seconds from the start)."""
    rng = random.Random(seed)
    fleet = [_Engine() for _ in range(engines)]
    left_in_batch: dict[int, int] = {}
    events: list[tuple[float, int, int]] = []  # (time, order, engine index; -1 = the trainer's step ends)
    order = 0

    def schedule(when: float, who: int) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (when, order, who))

    def step_or_load(i: int, now: float) -> None:
        engine = fleet[i]
        engine.loading = engine.load_due
        if engine.load_due:
            engine.load_due, engine.busy_until = False, now + s
        elif engine.running or engine.queue:
            admitted = 0
            while engine.queue and len(engine.running) < cap:
                engine.running.append(engine.queue.popleft())
                admitted += 1
            seconds = latency.decode_base_s + latency.decode_s_per_seq * len(engine.running)
            engine.busy_until = now + seconds + latency.prefill_s_per_token * prompt_tokens * admitted
        else:
            engine.busy_until = None
            return
        schedule(engine.busy_until, i)

    def admit(b: int, now: float) -> None:
        left_in_batch[b] = batch
        for _ in range(batch):
            i = min(range(engines), key=lambda k: fleet[k].outstanding)
            length = round(rng.lognormvariate(math.log(latency.length_median), latency.length_sigma))
            fleet[i].queue.append([min(max_new_tokens, max(1, length)), b])
            if fleet[i].busy_until is None:
                step_or_load(i, now)

    def hand_off_to(i: int) -> None:
        """The engine client's straggler hand-off: an engine that ran dry takes the newer half of
        the requests of the engine holding the most, with their tokens so far."""
        donor = max((e for e in fleet if e is not fleet[i]), key=lambda e: e.outstanding, default=None)
        if donor is None or donor.outstanding < 2:
            return
        for _ in range(donor.outstanding // 2):
            fleet[i].queue.append(donor.queue.pop() if donor.queue else donor.running.pop())

    version, training, publishes = 0, False, []

    def maybe_train(now: float) -> None:
        nonlocal training
        if not training and left_in_batch.get(version) == 0:
            training = True
            schedule(now + t, -1)

    for b in range(max_lag + 1):
        admit(b, 0.0)
    while len(publishes) < count:
        now, _, who = heapq.heappop(events)
        if who == -1:  # the trainer publishes version + 1; the engines load it, and the bound admits one more batch
            training, version = False, version + 1
            publishes.append(now)
            for i, engine in enumerate(fleet):
                engine.load_due = True
                if engine.busy_until is None:
                    step_or_load(i, now)
            admit(version + max_lag, now)
        else:
            engine = fleet[who]
            if not engine.loading:  # a decode step ended: every running sequence has one more token
                for sequence in engine.running:
                    sequence[0] -= 1
                for _, b in [q for q in engine.running if q[0] <= 0]:
                    left_in_batch[b] -= 1
                engine.running = [q for q in engine.running if q[0] > 0]
                if not engine.running and not engine.queue:
                    hand_off_to(who)
            step_or_load(who, now)
        maybe_train(now)
    return publishes
