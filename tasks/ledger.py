"""The ledger: the trainer's exactly-once record, saved in every checkpoint and at the end of a run.

Every shard key the learner has disposed of, with its fate (trained, dropped stale, dropped
without signal, quarantined, duplicate of a group already trained, dropped, or chosen for the
batch being filled), the ids of the
groups trained and dropped, the lag of each trained group, and the samples by fate. A trainer
resumed from checkpoint K restores the ledger of step K: it neither skips nor repeats a shard.
tasks/report.py checks the accounting identity from its counts, the generators' own records of
what they committed, and a listing of the shards still pending.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

LEDGER_KEY = "lag/ledger.json"
COUNTS = ("trained", "dropped_stale", "dropped_no_signal", "quarantined", "duplicate")
"""The ledger's sample counts, one per fate: with the shards pending, the accounting identity."""
FATE_COUNTS = {"trained": "trained", "stale": "dropped_stale", "no_signal": "dropped_no_signal", "quarantined": "quarantined",
               "duplicate": "duplicate"}  # fmt: skip
LOST_FATES = ("stale", "no_signal", "quarantined")
"""Fates of groups that will never be trained: generators may make others in their place."""


@dataclass
class Ledger:
    """Every shard the learner has disposed of, and the counts of the accounting identity."""

    disposed: dict[str, str] = field(default_factory=dict)
    """Shard key -> "trained", "stale", "no_signal", "quarantined" or "duplicate"."""
    trained_groups: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    """Samples by fate (quarantined counts shards: a corrupt shard's rows cannot be counted)."""
    lost_groups: int = 0
    """Groups that will never be trained (stale, without signal, quarantined): generators may
    replace them."""
    dropped_groups: list[str] = field(default_factory=list)
    """Group ids dropped (stale or without signal): a later copy of one (an adopted claim's first
    owner committing after all) is a duplicate, neither a second loss nor trained after its
    replacement was owed."""
    lags: list[int] = field(default_factory=list)
    """Lag of every trained group, in training order."""

    def count(self, fate: str, samples: int) -> None:
        """Count `samples` of a group disposed of as `fate`, and the group as lost if it is."""
        self.counts[FATE_COUNTS[fate]] += samples
        self.lost_groups += fate in LOST_FATES

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Ledger:
        """A ledger saved before a fate was counted has none of it."""
        return cls(**data | {"counts": dict.fromkeys(COUNTS, 0) | data.get("counts", {})})
