"""One pipeline at a time per run directory: the pipeline's lease on `{run}/lease.json`.

Two pipelines on one run id (a resubmission while the run still trains, a retrain beside the
nightly one, two `prefect deployment run` without a run id) would run two trainers and two
generators of the same producer names on one directory: each trainer publishing versions over
the other's, each generator claiming slots the other's shards then collide with. Nothing in the
shards or snapshots can tell the two apart afterwards, so the second pipeline is refused at its
start instead (`RunInUse`, naming the first).

The lease is a small record (holder, host, pid, time) that the holder renews every third of
`LEASE_SECONDS` from a thread of its own and deletes when it ends. A holder that died without
deleting it (SIGKILL, a lost machine) is taken over once its record is `LEASE_SECONDS` old, or
at once by a claimant on the same host that finds the holder's process gone (the usual case of
a `tandem run` stopped with Ctrl-C and started again). The first claim is a put-if-absent, so
two pipelines starting together cannot both take a free run. Times are compared across hosts,
which must agree on the clock to within a few seconds, as NTP keeps them.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from infra.storage import RunStore

LEASE_KEY = "lease.json"
LEASE_SECONDS = 60.0
"""How long a lease outlives its holder's last renewal: a pipeline that died without releasing
it keeps its run for at most this long (less on its own host, where a dead pid is seen at once)."""


class RunInUse(RuntimeError):
    """Another pipeline holds the run directory."""


@contextmanager
def hold_run(store: RunStore, holder: str) -> Iterator[None]:
    """Hold `store`'s run for the body: RunInUse if another live pipeline holds it."""
    claim_run(store, holder)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_SECONDS / 3):
            try:
                store.write_atomic(LEASE_KEY, _record(holder))
            except Exception:  # storage trouble: the next renewal tries again, well within the lease
                continue

    renewer = threading.Thread(target=renew, name="tandem-run-lease", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        if (read_lease(store) or {}).get("holder") == holder:
            store.delete(LEASE_KEY)


def claim_run(store: RunStore, holder: str) -> None:
    """Take the lease for `holder` (a new claim, or its own again, or a lapsed one); RunInUse
    naming the holder otherwise."""
    if store.put_if_absent(LEASE_KEY, _record(holder)):
        return
    check_run_free(store, holder)
    store.write_atomic(LEASE_KEY, _record(holder))


def check_run_free(store: RunStore, holder: str | None = None) -> None:
    """RunInUse unless the run's lease is free, lapsed, or `holder`'s own."""
    lease = read_lease(store)
    if lease is None or lease.get("holder") == holder or not _alive(lease):
        return
    age = max(0.0, time.time() - float(lease["at"]))
    raise RunInUse(
        f"run {store.url} is in use by pipeline {lease['holder']} on {lease['host']} (pid {lease['pid']}), "
        f"last seen {age:.0f} s ago: wait for it to end or cancel it; a pipeline that died is taken over "
        f"{LEASE_SECONDS:.0f} s after it was last seen"
    )


def read_lease(store: RunStore) -> dict | None:
    """The lease's record; None if there is none (or what is there is not one of ours)."""
    try:
        lease = json.loads(store.read_bytes(LEASE_KEY))
    except (FileNotFoundError, ValueError):
        return None
    return lease if isinstance(lease, dict) and {"holder", "host", "pid", "at"} <= lease.keys() else None


def _alive(lease: dict) -> bool:
    if time.time() - float(lease["at"]) >= LEASE_SECONDS:
        return False
    if lease["host"] != socket.gethostname():
        return True
    try:
        os.kill(int(lease["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _record(holder: str) -> bytes:
    return json.dumps({"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}).encode()
