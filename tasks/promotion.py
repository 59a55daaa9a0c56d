"""The PROMOTED pointer of a run: the best snapshot so far, moved only when a new one scores better.

`{root}/{run_id}/PROMOTED.json` names a run directory, a version, its held-out score and the
evaluation setup that score was measured under (tasks/evaluation.py `evaluation_setup`). It is
what a serving system would load, so scheduled retraining (flows/retrain.py) may only ever move
it forward in score, and only compares scores of one setup: a retraining that made the policy
worse leaves it where it was, and one evaluated on other prompts or rules has the promoted
snapshot scored again under its own setup first (`rescore_promoted`).

The promoted snapshot is pinned in its own run directory so that retention keeps it, under a
name of the PROMOTED that names it (`promoted_pin`): a run's snapshot may be promoted both by
the run it started from and by its own PROMOTED, and under one name the second pin moved the
first off its snapshot, which retention then deleted under the first PROMOTED. Moving PROMOTED
pins the new snapshot, writes the pointer, then drops the old snapshot's pin, in that order:
a move cut short keeps both, never neither.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass

from infra.storage import RunStore
from tasks.snapshots import pin_snapshot, unpin_snapshot

PROMOTED_KEY = "PROMOTED.json"


@dataclass(frozen=True)
class Promotion:
    """A snapshot named by PROMOTED: which run, which version, what it scored, under which setup
    (None: recorded before setups were, so comparable with no score measured now)."""

    run_url: str
    version: int
    score: float
    at: float = 0.0
    setup: str | None = None


def read_promoted(store: RunStore) -> Promotion | None:
    try:
        return Promotion(**json.loads(store.read_bytes(PROMOTED_KEY)))
    except FileNotFoundError:
        return None


def promoted_pin(store: RunStore, holder_url: str) -> str:
    """The pin consumer, in the run at `holder_url`, of the snapshot `store`'s PROMOTED names:
    `promoted` in the run itself, `promoted-by-{run id}` in another (a successor)."""
    return "promoted" if holder_url == store.url else f"promoted-by-{store.url.rsplit('/', 1)[-1]}"


def promote_if_better(
    store: RunStore, candidate_store: RunStore, version: int, score: float, bar: float, setup: str,
    previous_store: RunStore | None = None,
) -> bool:  # fmt: skip
    """Point `store`'s PROMOTED at `candidate_store`'s snapshot `version` if its `score`, measured
    under `setup`, beats `bar`: the promoted snapshot's score under that setup, or with nothing
    promoted the best the run has recorded. A score that is not a number never moves it. Returns
    whether it moved. `previous_store`: the run of the snapshot PROMOTED named so far, whose pin
    of it is dropped once the pointer has moved (None: it names none, or its run is gone)."""
    if not math.isfinite(score) or score <= bar:
        return False
    previous = read_promoted(store)
    pin_snapshot(candidate_store, promoted_pin(store, candidate_store.url), version)
    _write(store, Promotion(candidate_store.url, version, score, time.time(), setup))
    if previous is not None and previous_store is not None and previous.run_url != candidate_store.url:
        unpin_snapshot(previous_store, promoted_pin(store, previous.run_url))
    return True


def rescore_promoted(store: RunStore, promotion: Promotion, score: float, setup: str) -> Promotion:
    """Record the promoted snapshot's `score` under `setup`, measured again because the one
    recorded was of another setup; it stays promoted, since when it was."""
    rescored = dataclasses.replace(promotion, score=score, setup=setup)
    _write(store, rescored)
    return rescored


def _write(store: RunStore, promotion: Promotion) -> None:
    store.write_atomic(PROMOTED_KEY, json.dumps(asdict(promotion)).encode())
