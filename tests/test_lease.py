"""The run lease: one pipeline at a time per run directory, on file:// and S3; a holder
that died gives the run up (at once on its own host, after LEASE_SECONDS elsewhere)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from infra.storage import RunStore
from tasks import lease
from tasks.lease import LEASE_KEY, RunInUse, check_run_free, claim_run, hold_run, read_lease


def test_a_second_pipeline_is_refused_while_the_first_holds_the_run(store: RunStore):
    with hold_run(store, "first (1)"):
        with pytest.raises(RunInUse, match=r"in use by pipeline first \(1\) on .*last seen \d+ s ago"):
            claim_run(store, "second (2)")
        claim_run(store, "first (1)")  # its own again: a retried flow run
    assert read_lease(store) is None, "released at the end"
    with hold_run(store, "second (2)"):
        assert read_lease(store)["holder"] == "second (2)"


def test_the_lease_is_renewed_while_held(store: RunStore, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_SECONDS", 0.6)
    with hold_run(store, "first (1)"):
        claimed = read_lease(store)["at"]
        time.sleep(0.9)  # past the lease: only renewals keep it
        assert read_lease(store)["at"] > claimed
        with pytest.raises(RunInUse):
            check_run_free(store)


def _write_lease(store: RunStore, **fields) -> None:
    record = {"holder": "dead (0)", "host": "elsewhere", "pid": 1, "at": time.time()} | fields
    store.write_atomic(LEASE_KEY, json.dumps(record).encode())


def test_a_lapsed_lease_of_another_host_is_taken_over(store: RunStore):
    _write_lease(store, at=time.time() - lease.LEASE_SECONDS + 5)
    with pytest.raises(RunInUse, match="on elsewhere"):
        claim_run(store, "new (1)")
    _write_lease(store, at=time.time() - lease.LEASE_SECONDS - 1)
    claim_run(store, "new (1)")
    assert read_lease(store)["holder"] == "new (1)"


def test_a_lease_whose_process_is_gone_on_this_host_is_taken_over_at_once(store: RunStore):
    """`tandem run` stopped with Ctrl-C exits without releasing it (os._exit) and is started again."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lease(store, host=socket.gethostname(), pid=int(gone.stdout))
    claim_run(store, "new (1)")
    assert read_lease(store)["holder"] == "new (1)"
