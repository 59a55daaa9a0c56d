"""Groups that failed: set aside with the failure's record, and replaced.

A group whose environment raised, hung, or paid a reward a shard cannot hold (tasks/envthread.py
`EnvironmentFailed`) is not committed; nor is one whose requests the engines aborted at every
try (tasks/generator.py `requeue_unfinished`). Its generator writes the failure's record (the
error, the prompt, the producer; an environment's traceback) to
`quarantine/failed-groups/{slot:06d}.json`, put-if-absent, and from then on:

- its slot is spent (`spent_slots`: committed or set aside): a restarted generator does not play
  it again, nor does a retry of its chunk, which finds the record, nor a producer its claims are
  handed to (tasks/lag.py `adopt_orphaned_claims`), and the deployed supervisor does not count
  it among a generator's unfinished claims: the key names the slot alone, which is the run's;
- the trainer counts it lost as soon as it sees it (tasks/learner.py `_count_quarantined`), so
  that admission returns its capacity and a generator makes another group in its place;
- the run's summary counts these groups (tasks/report.py), apart from the samples' accounting
  identity: they hold no sample.

A prefix of their own, not the group's shard key under quarantine/ as a bad shard has: a record
under the shard's key was taken for that shard wherever a key means one (a restarted generator's
recovery of its committed groups, a retried chunk's check for its own commits), and quarantining
under it deletes the key in rollouts/, where a concurrent try of the same chunk may have
committed the group after all.
"""

from __future__ import annotations

import json
import re

from infra.storage import RunStore
from tasks.shards import committed_slots

FAILED_GROUPS = "quarantine/failed-groups"
_FAILED_GROUP_KEY = re.compile(rf"{FAILED_GROUPS}/(?P<slot>\d{{6,}})\.json")


def failed_group_key(slot: int) -> str:
    return f"{FAILED_GROUPS}/{slot:06d}.json"


def set_aside_group(store: RunStore, slot: int, record: dict) -> str:
    """Write the record of slot `slot`'s failed group (the first one, if a retry failed it again);
    returns its key."""
    key = failed_group_key(slot)
    store.put_if_absent(key, json.dumps(record, indent=1).encode())
    return key


def failed_group_slots(store: RunStore) -> dict[int, str]:
    """Slot -> record key of every group set aside, from one listing."""
    found = (_FAILED_GROUP_KEY.fullmatch(key) for key in store.list_recursive(FAILED_GROUPS))
    return {int(match["slot"]): match[0] for match in found if match}


def spent_slots(store: RunStore) -> set[int]:
    """The slots whose group is done with: committed (in rollouts/ or quarantined) or set aside.
    A claim of one of them is nobody's work to finish."""
    return set(committed_slots(store)) | set(failed_group_slots(store))
