"""The run lease: one pipeline at a time per run directory, on file:// and S3; a holder that died
gives the run up (at once in its own pid namespace, after LEASE_SECONDS elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from infra.storage import RunStore
from tasks import lease
from tasks.lease import PipelineWatch, RunInUse, check_run_free, claim_run, hold_run, lease_key, process_namespace, read_lease


def test_a_second_pipeline_is_refused_while_the_first_holds_the_run(store: RunStore):
    with hold_run(store, "first (1)"):
        with pytest.raises(RunInUse, match=r"in use by pipeline first \(1\) on .*last seen \d+ s ago"):
            claim_run(store, "second (2)")
    assert read_lease(store) is None, "released at the end"
    with hold_run(store, "second (2)"):
        assert read_lease(store)["holder"] == "second (2)"


def test_a_retried_pipeline_takes_its_run_back_at_once_and_its_first_attempt_leaves_it(store: RunStore):
    with hold_run(store, "first (1)"):
        retry = claim_run(store, "first (1)")  # the same flow run, retried: its own again
    assert read_lease(store)["claim"] == retry, "the first attempt's end does not release the retry's claim"


def test_the_lease_is_renewed_while_held(store: RunStore, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_SECONDS", 1.5)
    with hold_run(store, "first (1)"):
        claimed = read_lease(store)["at"]
        time.sleep(2.0)  # past the lease: only renewals keep it
        assert read_lease(store)["at"] > claimed
        with pytest.raises(RunInUse):
            check_run_free(store)


def _write_lease(store: RunStore, renewal: bool = False, **fields) -> None:
    """Another pipeline's claim of the run (the term after the highest), or its `renewal`."""
    terms = [int(key[-len("00000000.json") : -len(".json")]) for key in store.list("lease")]
    term = max(terms, default=0) + (0 if renewal else 1)
    record = {"holder": "dead (0)", "where": ["elsewhere", "", ""], "pid": 1, "at": time.time()} | fields
    store.write_atomic(lease_key(term), json.dumps(record).encode())


def _release(store: RunStore) -> None:
    """What the holder's end does to its term."""
    lease = read_lease(store)
    store.write_atomic(lease_key(lease["term"]), json.dumps({"holder": lease["holder"], "released": time.time()}).encode())


def _slowed(store: RunStore, seconds: float, writes: tuple[str, ...] = ("write_atomic", "put_if_absent")) -> RunStore:
    """Another client of `store`'s run whose `writes` land `seconds` after they are made."""
    slow = RunStore(store.fs, store.base, store.url, store.retry_seconds)
    for name in writes:
        write = getattr(slow, name)
        setattr(slow, name, lambda *args, _write=write, **kwargs: (time.sleep(seconds), _write(*args, **kwargs))[1])
    return slow


def test_a_lapsed_lease_of_another_host_is_taken_over(store: RunStore):
    _write_lease(store, at=time.time() - lease.LEASE_SECONDS + 5)
    with pytest.raises(RunInUse, match="on elsewhere"):
        claim_run(store, "new (1)")
    _write_lease(store, at=time.time() - lease.LEASE_SECONDS - 1)
    claim_run(store, "new (1)")
    assert read_lease(store)["holder"] == "new (1)"


def test_a_lease_whose_process_is_gone_here_is_taken_over_at_once(store: RunStore):
    """`tandem run` stopped with Ctrl-C exits without releasing it (os._exit) and is started again."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lease(store, where=process_namespace(), pid=int(gone.stdout))
    claim_run(store, "new (1)")
    assert read_lease(store)["holder"] == "new (1)"


def test_a_dead_pid_of_another_pid_namespace_on_this_host_does_not_free_the_run(store: RunStore):
    """Containers sharing the host's name (host networking) number their processes apart."""
    host, boot, _ = process_namespace()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lease(store, where=[host, boot, "another-namespace"], pid=int(gone.stdout))
    with pytest.raises(RunInUse):
        claim_run(store, "new (1)")


def test_of_two_pipelines_taking_over_a_lapsed_lease_together_one_wins(store: RunStore):
    _write_lease(store, at=time.time() - lease.LEASE_SECONDS - 1)
    outcomes: dict[str, str] = {}

    def claim(holder: str) -> None:
        try:
            claim_run(store, holder)
            outcomes[holder] = "won"
        except RunInUse:
            outcomes[holder] = "refused"

    claimants = [threading.Thread(target=claim, args=(f"p{i} ({i})",)) for i in range(2)]
    for thread in claimants:
        thread.start()
    for thread in claimants:
        thread.join()
    assert sorted(outcomes.values()) == ["refused", "won"], outcomes
    assert outcomes[read_lease(store)["holder"]] == "won"


def test_a_takeover_whose_write_lands_late_does_not_make_two_holders(store: RunStore):
    """Two pipelines take over one lapsed lease, one's writes slower than the other's whole
    claim: a claim that decided by reading its write back a second later let both win."""
    _write_lease(store, at=time.time() - lease.LEASE_SECONDS - 1)
    outcomes: dict[str, str] = {}

    def claim(client: RunStore, holder: str) -> None:
        try:
            claim_run(client, holder)
            outcomes[holder] = "won"
        except RunInUse:
            outcomes[holder] = "refused"

    slow = threading.Thread(target=claim, args=(_slowed(store, 1.5), "slow (1)"))
    slow.start()
    time.sleep(0.2)
    claim(store, "fast (2)")
    slow.join()
    assert sorted(outcomes.values()) == ["refused", "won"], outcomes
    assert outcomes[read_lease(store)["holder"]] == "won"


def test_a_claim_whose_write_lands_after_a_later_claim_is_lost(store: RunStore):
    """The slow claimant's put of term 2 is held up while another pipeline claims term 2 and, as a
    retried flow run of the same name, term 3, deleting term 2: the slow put then succeeds, and
    its term is not the lease."""
    _write_lease(store, at=time.time() - lease.LEASE_SECONDS - 1)
    outcome: dict[str, str] = {}

    def slow_claim() -> None:
        try:
            claim_run(_slowed(store, 1.5, ("put_if_absent",)), "slow (1)")
            outcome["slow"] = "won"
        except RunInUse:
            outcome["slow"] = "refused"

    slow = threading.Thread(target=slow_claim)
    slow.start()
    time.sleep(0.2)
    claim_run(store, "fast (2)")
    retried = claim_run(store, "fast (2)")
    slow.join()
    assert outcome == {"slow": "refused"} and read_lease(store)["claim"] == retried


def test_a_live_lease_of_an_earlier_release_is_respected(store: RunStore):
    """A pipeline of a release before the terms renews `lease.json` and sees no terms: a pipeline
    of this release must not start beside it on the same run."""
    record = {"holder": "old (1)", "claim": "c0", "where": ["elsewhere", "", ""], "pid": 1, "at": time.time()}
    store.write_atomic(lease.LEGACY_LEASE_KEY, json.dumps(record).encode())
    with pytest.raises(RunInUse, match=r"pipeline old \(1\)"):
        claim_run(store, "new (2)")
    with pytest.raises(RunInUse):
        check_run_free(store)
    store.write_atomic(lease.LEGACY_LEASE_KEY, json.dumps(record | {"at": time.time() - lease.LEASE_SECONDS - 1}).encode())
    claim_run(store, "new (2)")


def test_a_renewal_that_lands_after_a_takeover_does_not_take_the_run_back(store: RunStore, monkeypatch):
    """The holder stalled past its lease with a renewal on its way: the renewal lands after
    another pipeline took the run over, and must not overwrite that pipeline's claim."""
    monkeypatch.setattr(lease, "LEASE_SECONDS", 1.5)
    with hold_run(_slowed(store, 2.0, ("write_atomic",)), "stalled (1)"):  # its first renewal: made at 0.5 s, lands at 2.5 s
        time.sleep(1.7)  # its claim is 1.7 s old: lapsed
        successor = claim_run(store, "successor (2)")
        time.sleep(1.5)
        assert read_lease(store)["claim"] == successor, "the late renewal landed on the successor's claim"
    assert read_lease(store)["claim"] == successor, "the stalled holder's end leaves the run to its successor"


def test_a_holder_that_lost_its_lease_does_not_take_it_back(store: RunStore, monkeypatch):
    """It stalled past the lease and another pipeline took the run over: renewing would hand the
    run to both, and releasing at its end would free it under the other."""
    monkeypatch.setattr(lease, "LEASE_SECONDS", 1.5)
    with hold_run(store, "stalled (1)"):
        _write_lease(store, holder="successor (2)", where=process_namespace())
        time.sleep(1.2)  # more than a renewal interval
        assert read_lease(store)["holder"] == "successor (2)"
    assert read_lease(store)["holder"] == "successor (2)"


def test_a_child_sees_its_pipeline_go(store: RunStore, monkeypatch):
    """A deployed pipeline's children run on other machines, and Prefect does not stop them when
    it dies or gives up: they watch the lease claim their pipeline passed them."""
    monkeypatch.setattr(lease, "STALE_SECONDS", 1.0)
    assert PipelineWatch(store, None, interval=0).gone() is None, "given no claim: no pipeline to outlive"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ended = [("released", lambda: _release(store), "no longer holds"),
             ("taken over", lambda: _write_lease(store, holder="q (2)", claim="c2"), "pipeline q (2) has taken"),
             ("retried", lambda: _write_lease(store, holder="p (1)", claim="c3"), "pipeline p (1) has taken"),
             ("not renewed", lambda: time.sleep(1.2), "p (1) has not renewed its lease"),
             ("process gone here", lambda: _write_lease(store, True, holder="p (1)", claim="c1", where=process_namespace(), pid=int(gone.stdout)),
              "p (1)'s process")]  # fmt: skip
    for case, end, said in ended:
        _write_lease(store, holder="p (1)", claim="c1", at=123.0)  # a clock far off: the child times renewals itself
        watch = PipelineWatch(store, "c1", interval=0)
        assert watch.gone() is None, case
        _write_lease(store, True, holder="p (1)", claim="c1", at=124.0)  # a renewal
        assert watch.gone() is None, case
        end()
        assert said in (watch.gone() or ""), case
        assert (watch.successor is not None) == (case in ("taken over", "retried")), case
        _write_lease(store, holder="p (1)", claim="c1")
        assert said in watch.gone(), f"{case}: a pipeline gone stays gone"


def test_a_pipeline_gone_is_looked_at_again_for_a_successor_when_asked_now(store: RunStore, monkeypatch):
    """A pipeline whose renewals stopped (storage writes failing, reads not) saw itself gone, no
    successor known; another pipeline then took the run over. Its stop of the children, trusting
    the answer it had, wrote a stop request into the successor's run and stopped its trainer."""
    monkeypatch.setattr(lease, "STALE_SECONDS", 0.5)
    _write_lease(store, holder="p (1)", claim="c1")
    watch = PipelineWatch(store, "c1", interval=0)
    assert watch.gone() is None
    time.sleep(0.7)
    assert "has not renewed" in watch.gone() and watch.successor is None
    _write_lease(store, holder="q (2)", claim="c2")
    assert "has not renewed" in watch.gone(), "not read again unless asked now"
    assert "pipeline q (2) has taken" in watch.gone(now=True) and watch.successor == "q (2)"


def test_a_failed_read_of_the_lease_does_not_count_towards_its_staleness(store: RunStore, monkeypatch):
    """A renewer held up by a slow store renews late; the child must not take that for death."""
    monkeypatch.setattr(lease, "STALE_SECONDS", 1.0)
    _write_lease(store, holder="p (1)", claim="c1")
    watch = PipelineWatch(store, "c1", interval=0)
    assert watch.gone() is None
    time.sleep(0.8)
    monkeypatch.setattr(lease, "read_lease", lambda store: (_ for _ in ()).throw(OSError("storage away")))
    assert watch.gone() is None
    monkeypatch.undo()
    monkeypatch.setattr(lease, "STALE_SECONDS", 1.0)
    time.sleep(0.8)
    assert watch.gone() is None, "the clock starts again at the first read that works"
    time.sleep(1.2)
    assert "has not renewed" in watch.gone()


def test_a_child_reads_the_lease_once_an_interval_unless_told_to_now(store: RunStore):
    _write_lease(store, holder="p (1)", claim="c1")
    watch = PipelineWatch(store, "c1", interval=3600)
    assert watch.gone() is None
    _release(store)
    assert watch.gone() is None
    assert "no longer holds" in watch.gone(now=True)


def test_a_pipeline_gives_its_children_a_claim_of_its_own(store: RunStore):
    with hold_run(store, "p (1)") as first:
        assert read_lease(store)["claim"] == first and PipelineWatch(store, first, interval=0).gone() is None
    with hold_run(store, "p (1)") as retried:  # a retried flow run: the same name, another claim
        assert retried != first and "has taken" in PipelineWatch(store, first, interval=0).gone()


def test_a_trainer_or_generator_started_by_hand_is_refused_while_a_pipeline_holds_the_run(tmp_path):
    """A deployment's Run button starts `training/tandem` or `generation/tandem` with no claim:
    beside a running pipeline, such a trainer aborted the live trainer's uploads and published
    over its versions, and such a generator's claims collided with the real one's."""
    from configs import TINY_CONFIG, load_config
    from flows.generation import generation
    from flows.training import training
    from infra.storage import open_run_store

    config = load_config(TINY_CONFIG, [f"storage.root=file://{tmp_path}/runs", "run_id=held"])
    store = open_run_store(config.storage, config.run_id)
    with hold_run(store, "pipeline (1)"):
        for started_by_hand in (lambda: training.fn(config), lambda: generation.fn(config, "gen0")):
            with pytest.raises(RunInUse, match="in use by pipeline pipeline \\(1\\)"):
                started_by_hand()
    assert not store.list("weights") and not store.list("trainer"), "nothing written"
