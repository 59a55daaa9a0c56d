"""The deployed parent (flows/supervisor.py) and the UI artifacts (flows/ui.py) ride out a Prefect
API that is away. No server: a stand-in client fails the way Prefect's does once its own retries
are spent."""

from __future__ import annotations

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
    parent.training, parent.training_state, parent.api_lost_at = SimpleNamespace(id=uuid4(), name="t"), Running(), None
    parent.restart_failed_generators = lambda: None
    parent.scale_to = lambda wanted: None
    parent.wanted_generators = lambda: 1
    return parent


def test_watch_looks_again_while_the_api_is_away_and_sees_training_finish():
    parent = _supervisor([Running(), httpx.ConnectError("refused"), _status_error(503), Completed()])
    assert [parent.watch().is_final() for _ in range(4)] == [False, False, False, True]
    assert parent.api_lost_at is None, "an answer ends the outage"


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
