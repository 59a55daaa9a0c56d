"""One pipeline at a time per run directory: the pipeline's lease, under `{run}/lease/`.

Two pipelines on one run id (a resubmission while the run still trains, a retrain beside the
nightly one, two `prefect deployment run` without a run id) would run two trainers and two
generators of the same producer names on one directory: each trainer publishing versions over
the other's, each generator claiming slots the other's shards then collide with. Nothing in the
shards or snapshots can tell the two apart afterwards, so the second pipeline is refused at its
start instead (`RunInUse`, naming the first).

The lease is a small record (holder, claim id, where, pid, time) that the holder renews every
third of `LEASE_SECONDS` from a thread of its own and releases when it ends. A holder that died without
releasing it (SIGKILL, a lost machine) is taken over once its record is `LEASE_SECONDS` old, or
at once by a claimant in the same pid namespace of the same boot that finds the holder's process
gone (the usual case of a `tandem run` stopped with Ctrl-C and started again; containers that
share a host name have pid namespaces of their own, so the host name alone would not do).

Each claim opens a term: the put-if-absent of the next term's record, `lease/{term:08d}.json`,
and the highest term is the lease. Two pipelines claiming one free or lapsed lease together both
ask for the same next term, and only one gets it (object storage has no compare-and-swap to take
over one record in place, and a write-then-read-back would let a write that lands late decide);
a claim whose term is not the highest once its write has landed (a put so slow that a later
claim passed it, and deleted its term) is lost too. A holder renews only its own term's record, so a
renewal that lands after a successor's claim (a holder stalled past its lease) cannot overwrite
the successor's, and a holder that sees a later term stops renewing and logs it rather than
take the run back. Releasing marks the holder's term released; it is never deleted, so terms
only grow, and a claim deletes the terms below its own. Times are compared across hosts, which
must agree on the clock to within a few seconds, as NTP keeps them.

The lease is also how a pipeline's children know it is still there (`PipelineWatch`): each claim
has an id, which the pipeline passes to its training and generation runs, and they stop once the
run is no longer held by that claim.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from infra.storage import RunStore

log = logging.getLogger(__name__)

LEASE_PREFIX = "lease"
"""Where the lease's terms are: one record a claim, `lease/{term:08d}.json`; the highest is the lease."""
LEASE_SECONDS = 60.0
"""How long a lease outlives its holder's last renewal: a pipeline that died without releasing
it keeps its run for at most this long (less on its own host, where a dead pid is seen at once)."""
CLAIM_ATTEMPTS = 5
"""How many terms a claimant tries before it gives up: each it loses went to another claimant,
which then holds the run unless it let it go at once."""
_FIELDS = {"holder", "where", "pid", "at"}


WATCH_SECONDS = LEASE_SECONDS / 6
"""How often a child run reads the lease to see whether its pipeline is still there."""
STALE_SECONDS = 2 * LEASE_SECONDS
"""How long a child waits for a renewal before it takes its pipeline for dead: longer than a
claimant waits (a successor's claim is seen sooner, as another claim), so that a renewer held up
by a slow store (each write retries for up to storage.retry_seconds from its first failure)
stops nothing."""


class RunInUse(RuntimeError):
    """Another pipeline holds the run directory."""


def lease_key(term: int) -> str:
    """The record of the lease's `term`."""
    return f"{LEASE_PREFIX}/{term:08d}.json"


@contextmanager
def hold_run(store: RunStore, holder: str) -> Iterator[str]:
    """Hold `store`'s run for the body, which gets the claim's id (for the children to watch it:
    `PipelineWatch`); RunInUse if another live pipeline holds it."""
    term, claim = _take(store, holder)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_SECONDS / 3):
            try:
                terms, current = _read_terms(store)
                if terms and terms[-1] > term:
                    log.error("lost the lease of %s to pipeline %s (this one stalled past %.0f s): no longer renewing it",
                              store.url, (current or {}).get("holder", "(released since)"), LEASE_SECONDS)  # fmt: skip
                    return
                store.write_atomic(lease_key(term), _record(holder, claim))
            except Exception as err:  # storage trouble: the next renewal tries again, well within the lease
                log.warning("could not renew the lease of %s: %r", store.url, err)

    # In the caller's context: its warnings then reach the flow run's logs in the UI (flows/__init__.py).
    renewer = threading.Thread(target=contextvars.copy_context().run, args=(renew,), name="tandem-run-lease", daemon=True)
    renewer.start()
    try:
        yield claim
    finally:
        stop.set()
        renewer.join()
        try:
            terms, _ = _read_terms(store)
            if terms and terms[-1] == term:  # a later term is a successor's: its lease is not ours to release
                store.write_atomic(lease_key(term), json.dumps({"holder": holder, "claim": claim, "released": time.time()}).encode())
        except Exception as err:  # the body's own outcome matters more; the lease lapses anyway
            log.warning("could not release the lease of %s (it lapses in %.0f s): %r", store.url, LEASE_SECONDS, err)


def claim_run(store: RunStore, holder: str) -> str:
    """Take the lease for `holder` (a free run, its own claim again, or a lapsed one) and return
    the claim's id; RunInUse naming the holder otherwise. Every claim has an id of its own: a
    retried flow run has the holder's name of the attempt it replaces, not its children."""
    return _take(store, holder)[1]


def _take(store: RunStore, holder: str) -> tuple[int, str]:
    """Claim the term after the highest for `holder`: (term, claim id)."""
    claim = uuid.uuid4().hex
    _refuse_if_held(store, _legacy_lease(store), holder)
    for _ in range(CLAIM_ATTEMPTS):
        terms, lease = _read_terms(store)
        _refuse_if_held(store, lease, holder)
        term = (terms[-1] if terms else 0) + 1
        store.put_if_absent(lease_key(term), _record(holder, claim))  # False: another's, or a retried put of ours
        if (read_lease(store) or {}).get("claim") != claim:  # lost the term, or won one that a later claim passed
            continue
        for old in terms:
            try:
                store.delete(lease_key(old))
            except Exception as err:  # a term left behind is below the lease: it decides nothing
                log.warning("could not delete the lease's term %d of %s: %r", old, store.url, err)
        return term, claim
    _refuse_if_held(store, read_lease(store), holder)
    raise RunInUse(f"run {store.url}: {CLAIM_ATTEMPTS} claims of its lease in a row went to other pipelines; try again")


def check_run_free(store: RunStore, holder: str | None = None) -> None:
    """RunInUse unless the run's lease is free, lapsed, or `holder`'s own."""
    _refuse_if_held(store, _legacy_lease(store), holder)
    _refuse_if_held(store, read_lease(store), holder)


def _refuse_if_held(store: RunStore, lease: dict | None, holder: str | None) -> None:
    if lease is None or lease.get("holder") == holder or not _alive(lease):
        return
    age = max(0.0, time.time() - float(lease["at"]))
    raise RunInUse(
        f"run {store.url} is in use by pipeline {lease['holder']} on {lease['where'][0]} (pid {lease['pid']}), "
        f"last seen {age:.0f} s ago: wait for it to end or cancel it; a pipeline that died is taken over "
        f"{LEASE_SECONDS:.0f} s after it was last seen"
    )


LEGACY_LEASE_KEY = "lease.json"
"""The one record releases before the terms kept: a pipeline of such a release may still hold it."""


def _legacy_lease(store: RunStore) -> dict | None:
    """The record of a pipeline of an earlier tandem release, which renews `lease.json` and sees no
    terms: a run it holds is refused until it ends or its record lapses, as a term's would be.
    (The other way round, such a release's children watch `lease.json` and stop at once under a
    pipeline of this one: a deployment's workers are upgraded together.)"""
    try:
        lease = json.loads(store.read_bytes(LEGACY_LEASE_KEY))
    except (FileNotFoundError, ValueError):
        return None
    return lease if isinstance(lease, dict) and _FIELDS <= lease.keys() else None


def read_lease(store: RunStore) -> dict | None:
    """The lease's record, its term under "term"; None if the run was never held or its holder
    released it (or what is there is not one of ours)."""
    return _read_terms(store)[1]


def _read_terms(store: RunStore) -> tuple[list[int], dict | None]:
    """The lease's terms, lowest first, and the highest one's record (as `read_lease`)."""
    terms = sorted(int(name[:-5]) for name in (key.rsplit("/", 1)[-1] for key in store.list(LEASE_PREFIX))
                   if name.endswith(".json") and name[:-5].isdigit())  # fmt: skip
    if not terms:
        return terms, None
    try:
        lease = json.loads(store.read_bytes(lease_key(terms[-1])))
    except (FileNotFoundError, ValueError):
        return terms, None
    if not (isinstance(lease, dict) and _FIELDS <= lease.keys()) or "released" in lease:
        return terms, None
    return terms, lease | {"term": terms[-1]}


class PipelineWatch:
    """A child run's check that the pipeline that started it still holds the run.

    A deployed pipeline's children run on other machines, and Prefect stops them only when their
    parent is cancelled, not when it dies (the trainer box lost) or gives up with the API away:
    the trainer would then wait for data and the generators hold their GPUs for good, and a
    resubmitted pipeline would run beside them. The pipeline passes its children its claim's id
    (`hold_run`), and the lease says whether that claim still holds the run: it is gone once the
    lease is released (or was never taken) or another claim's (`successor` then names its holder: the child must
    leave the run's shared state to it), once its process is gone (same host, boot and pid
    namespace), or once it has not been renewed for `STALE_SECONDS` of successful reads by the
    child's own clock. The child times the renewals it sees rather than compare the record's time
    with its clock, so a host whose clock is off does not stop a healthy run, and a read that fails
    (storage away) restarts that clock rather than counting towards it. A child given no claim (a
    flow run by hand, a test) has no pipeline to outlive. The lease is read at most once per
    `interval` (default `WATCH_SECONDS`)."""

    def __init__(self, store: RunStore, claim: str | None, interval: float | None = None):
        self.store, self.claim = store, claim
        self.interval = WATCH_SECONDS if interval is None else interval
        self.renewed: float | None = None
        self.renewal_seen = self.checked_at = -float("inf")
        self.reason: str | None = None
        self.successor: str | None = None

    def gone(self, now: bool = False) -> str | None:
        """Why the pipeline is gone; None while it holds the run. `now`: read the lease even if it
        was read less than `interval` ago; once gone, read it again if no successor is known yet,
        for a pipeline that took the run over since: its own pipeline, whose renewals had stopped,
        otherwise asked its children to stop through the run directory, and stopped the
        successor's trainer."""
        if self.claim is None or (self.reason is not None and (self.successor is not None or not now)):
            return self.reason
        if not now and time.monotonic() - self.checked_at < self.interval:
            return self.reason
        self.checked_at = time.monotonic()
        try:
            lease = read_lease(self.store)
        except Exception as err:
            log.warning("could not read the lease of %s: %r", self.store.url, err)
            if self.reason is None:
                self.renewed = None
            return self.reason
        if lease is not None and lease.get("claim") != self.claim:
            self.successor = lease["holder"]
            self.reason = f"pipeline {lease['holder']} has taken {self.store.url} over"
        elif self.reason is not None:  # gone stays gone
            pass
        elif lease is None:
            self.reason = f"the pipeline that started this run no longer holds {self.store.url}"
        elif _process_gone_here(lease):
            self.reason = f"pipeline {lease['holder']}'s process {lease['pid']} is gone"
        elif lease["at"] != self.renewed:
            self.renewed, self.renewal_seen = lease["at"], self.checked_at
        elif self.checked_at - self.renewal_seen > STALE_SECONDS:
            self.reason = f"pipeline {lease['holder']} has not renewed its lease of {self.store.url} for {self.checked_at - self.renewal_seen:.0f} s"
        return self.reason


def _alive(lease: dict) -> bool:
    if time.time() - float(lease["at"]) >= LEASE_SECONDS:
        return False
    return not _process_gone_here(lease)


def _process_gone_here(lease: dict) -> bool:
    """Whether the lease's holder process is known to be gone: it ran in this host, boot and pid
    namespace, where its pid means it, and no process has that pid. Elsewhere its pid says nothing."""
    if lease["where"] != process_namespace():
        return False
    try:
        os.kill(int(lease["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: alive
        return False
    return False


def process_namespace() -> list[str]:
    """This process's host name, boot and pid namespace: where its pid means this process."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # no /proc (macOS): one namespace per host
        boot = namespace = ""
    return [socket.gethostname(), boot, namespace]


def _record(holder: str, claim: str) -> bytes:
    return json.dumps({"holder": holder, "claim": claim, "where": process_namespace(), "pid": os.getpid(), "at": time.time()}).encode()
