"""The deployed parent (flows/supervisor.py) and the UI artifacts (flows/ui.py) ride out a Prefect
API that is away. No server: a stand-in client fails the way Prefect's does once its own retries
are spent."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace
from uuid import uuid4

import httpx
import pytest
from prefect.states import Completed, Running

import flows.supervisor as supervisor
from flows.supervisor import ChildRunFailed, Supervisor
from flows.ui import api_unavailable, best_effort
from tasks.lag import stop_reason
from tasks.lease import PipelineWatch, lease_key


def _status_error(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://127.0.0.1/api/flow_runs/x")
    return httpx.HTTPStatusError("boom", request=request, response=httpx.Response(code, request=request))


def test_which_errors_count_as_the_api_being_away():
    assert api_unavailable(httpx.ConnectError("refused")) and api_unavailable(httpx.ReadTimeout("slow"))
    assert api_unavailable(_status_error(503)) and api_unavailable(_status_error(500)) and api_unavailable(_status_error(429))
    assert not api_unavailable(_status_error(404)) and not api_unavailable(ValueError("a bug"))


class FlakyClient:
    """read_flow_run answers from `states`; an exception in it is raised instead."""

    def __init__(self, states):
        self.states = list(states)

    def read_flow_run(self, run_id):
        state = self.states.pop(0)
        if isinstance(state, BaseException):
            raise state
        return SimpleNamespace(state=state)


def _supervisor(states) -> Supervisor:
    parent = Supervisor.__new__(Supervisor)
    parent.client, parent.log = FlakyClient(states), logging.getLogger("test")
    parent.training, parent.training_state, parent.outage_since = SimpleNamespace(id=uuid4(), name="t"), Running(), None
    parent.pipeline = SimpleNamespace(gone=lambda now=False: None)  # it holds the run
    parent.restart_failed_generators = lambda: None
    parent.scale_to = lambda wanted: None
    parent.wanted_generators = lambda: 1
    return parent


def test_watch_looks_again_while_the_api_is_away_and_sees_training_finish():
    parent = _supervisor([Running(), httpx.ConnectError("refused"), _status_error(503), Completed()])
    assert [parent.watch().is_final() for _ in range(4)] == [False, False, False, True]
    assert parent.outage_since is None, "an answer ends the outage"


def test_watch_rides_out_the_run_s_storage_being_away_as_the_children_do():
    """Autoscale's metrics, the claims a restart checks and the retire requests are storage reads:
    a storage outage past storage.retry_seconds failed the parent, which cancelled healthy children."""
    from infra.storage import StorageUnavailable

    parent = _supervisor([Running(), Running(), Completed()])
    outage = [StorageUnavailable("storage at s3://tandem/run failed")]

    def scale_to(wanted: int) -> None:  # its first call meets the outage
        if outage:
            raise outage.pop()

    parent.scale_to = scale_to
    assert [parent.watch().is_final() for _ in range(3)] == [False, False, True]
    assert parent.outage_since is None


def test_watch_gives_up_after_a_long_outage_and_on_other_errors(monkeypatch):
    parent = _supervisor([httpx.ConnectError("refused")] * 2)
    monkeypatch.setattr(supervisor, "API_OUTAGE_SECONDS", 0.0)
    assert not parent.watch().is_final()
    time.sleep(0.01)
    with pytest.raises(ChildRunFailed, match="unavailable"):
        parent.watch()
    with pytest.raises(ValueError):
        _supervisor([ValueError("a bug")]).watch()


def test_ui_artifacts_are_best_effort_while_the_api_is_away():

    def failing(err):
        raise err

    assert best_effort(failing)(httpx.ConnectError("refused")) is None
    assert best_effort(failing)(_status_error(503)) is None
    with pytest.raises(httpx.HTTPStatusError):
        best_effort(failing)(_status_error(404))


class AwayClient(FlakyClient):
    """A Prefect API that stays away: reads and cancellations fail as Prefect's client does."""

    def set_flow_run_state(self, run_id, state, force=False):
        raise httpx.ConnectError("refused")


def _hold(store, holder: str, claim: str, term: int) -> None:
    record = {"holder": holder, "claim": claim, "where": ["elsewhere", "", ""], "pid": 1, "at": time.time()}
    store.write_atomic(lease_key(term), json.dumps(record).encode())


@pytest.mark.parametrize("taken_over", [False, True])
def test_a_parent_that_gives_up_with_the_api_away_stops_its_children_through_storage(file_store, monkeypatch, taken_over):
    """A cancellation cannot reach the children while the API is away, and a trainer left running
    would wait for data for good: the parent asks it to stop through the run directory, unless
    another pipeline has taken the run over (the stop would then be that pipeline's trainer's)."""
    monkeypatch.setattr(supervisor, "API_OUTAGE_SECONDS", 0.0)
    monkeypatch.setattr(supervisor, "CANCEL_WAIT_SECONDS", 0.0)
    _hold(file_store, "this (1)", "c1", 1)
    parent = _supervisor([])
    parent.client = AwayClient([httpx.ConnectError("refused")] * 20)
    parent.config = SimpleNamespace(prefect=SimpleNamespace(generators=0, watch_seconds=0.01), run_id="r")
    parent.store, parent.pipeline, parent.generators, parent.retiring = file_store, PipelineWatch(file_store, "c1", interval=0), {}, {}
    parent.target, parent.start = 0, lambda flow_name, **_: SimpleNamespace(id=uuid4(), name=flow_name, state=Running())
    monkeypatch.setattr(supervisor, "clear_scale_request", lambda run_id: None)
    if taken_over:
        _hold(file_store, "successor (2)", "c2", 2)
    with pytest.raises(ChildRunFailed, match="unavailable" if not taken_over else "no longer holds the run"):
        parent.run()
    assert (stop_reason(file_store) is None) == taken_over
    if not taken_over:
        assert "the Prefect API has been unavailable" in stop_reason(file_store)
