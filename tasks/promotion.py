"""The PROMOTED pointer of a run: the best snapshot so far, moved only when a new one scores better.

`{root}/{run_id}/PROMOTED.json` names a run directory, a version and its held-out score. It is
what a serving system would load, so scheduled retraining (flows/retrain.py) may only ever move
it forward in score: a retraining that made the policy worse leaves it where it was. The
promoted snapshot is pinned (consumer `promoted`) so that retention keeps it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from infra.storage import RunStore
from tasks.snapshots import pin_snapshot

PROMOTED_KEY = "PROMOTED.json"


@dataclass(frozen=True)
class Promotion:
    """A snapshot named by PROMOTED: which run, which version, what it scored."""

    run_url: str
    version: int
    score: float
    at: float = 0.0


def read_promoted(store: RunStore) -> Promotion | None:
    try:
        return Promotion(**json.loads(store.read_bytes(PROMOTED_KEY)))
    except FileNotFoundError:
        return None


def promote_if_better(store: RunStore, candidate_store: RunStore, version: int, score: float, baseline: float) -> bool:
    """Point `store`'s PROMOTED at `candidate_store`'s snapshot `version` if `score` beats the
    promoted score (or, with nothing promoted yet, `baseline`: the score retraining started
    from). Returns whether it moved."""
    current = read_promoted(store)
    if score <= (current.score if current else baseline):
        return False
    pin_snapshot(candidate_store, "promoted", version)
    promotion = Promotion(candidate_store.url, version, score, time.time())
    store.write_atomic(PROMOTED_KEY, json.dumps(asdict(promotion)).encode())
    return True
