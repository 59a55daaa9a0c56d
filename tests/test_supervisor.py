"""The deployed parent's decisions about its children (flows/supervisor.py): restarts, giving up
on a generator, retiring ones that die, and child starts that Prefect's client may resend. The
run directory is real (file://); the Prefect API is a stand-in that answers child states."""

from __future__ import annotations

import logging
import time
from collections import Counter
from types import SimpleNamespace
from uuid import UUID, uuid4

import httpx
import pytest
from prefect import flow
from prefect.runtime import flow_run as prefect_flow_run
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Completed, Failed, Running, Scheduled
from prefect.testing.utilities import prefect_test_harness
from prefect.variables import Variable

import flows.supervisor as supervisor
from configs.schema import RunConfig
from flows.scaling import clear_scale_request, pipeline_config, running_pipeline, scale_request, scale_variable, tag_for_scaling
from flows.supervisor import Supervisor
from tasks.lag import SlotClaims, TrainerState, publish_trainer_state, request_retire, retire_requested, stop_reason
from tasks.failed_groups import set_aside_group
from tasks.metrics import MetricsLog

PER_STEP = 4


class ChildStates:
    """read_flow_run answers the state set for each run id, Running for one started since."""

    def __init__(self):
        self.states: dict[UUID, object] = {}

    def read_flow_run(self, run_id):
        return SimpleNamespace(state=self.states.get(run_id, Running()), name=f"run-{run_id}", work_pool_name="training")

    def set_flow_run_state(self, run_id, state, force=False):
        self.states[run_id] = state


def parent_of(store, max_lag: int, restarts: int) -> Supervisor:
    parent = Supervisor.__new__(Supervisor)
    parent.config = RunConfig.model_validate({
        "training": {"prompts_per_step": PER_STEP}, "lag": {"max_lag": max_lag},
        "prefect": {"generation_restarts": restarts},
    })  # fmt: skip
    parent.store, parent.client, parent.log = store, ChildStates(), logging.getLogger("test")
    parent.generators, parent.retiring, parent.restarts, parent.gave_up, parent.abandoned = {}, {}, 0, False, {}
    parent.waiting_since, parent.warned_waiting = {}, set()
    parent.metrics, parent.booting = {}, {}
    parent.started = []

    def start(flow_name, **parameters):
        parent.started.append(parameters.get("producer", flow_name))
        return SimpleNamespace(id=uuid4(), name=flow_name, state=Running())

    parent.start = start
    return parent


def child(parent: Supervisor, producer: str, state, retiring: bool = False) -> None:
    run_id = uuid4()
    parent.client.states[run_id] = state
    (parent.retiring if retiring else parent.generators)[producer] = run_id


def claim_slots(store, producer: str, count: int) -> None:
    claims = SlotClaims(store, producer, PER_STEP)
    assert all(claims.claim(capacity=1000) is not None for _ in range(count))


@pytest.mark.parametrize("claimed, stops", [(PER_STEP, False), (PER_STEP + 1, True)])
def test_giving_up_on_a_generator_stops_the_run_once_its_claims_exceed_what_the_window_spares(file_store, claimed, stops):
    """Only a run of the same producer id generates the slots it claimed. Given up on while others
    run, its claims held capacity for good, and past max_lag x prompts_per_step of them the
    trainer waited for ever: the run now stops, saying why."""
    parent = parent_of(file_store, max_lag=1, restarts=0)
    claim_slots(file_store, "gen1", claimed)
    child(parent, "gen0", Running())
    child(parent, "gen1", Failed(message="boom"))
    parent.restart_failed_generators()
    assert parent.gave_up and list(parent.generators) == ["gen0"] and parent.started == []
    reason = stop_reason(file_store)
    assert (reason is not None) == stops
    if stops:
        assert "gen1" in reason and f"{claimed} groups" in reason and "prefect.generation_restarts" in reason


def test_after_a_give_up_the_target_goes_no_higher_than_the_runs_alive(file_store, caplog):
    parent = parent_of(file_store, max_lag=1, restarts=0)
    parent.target, parent.gave_up = 1, True
    child(parent, "gen0", Running())
    with caplog.at_level(logging.INFO, logger="test"):
        parent.set_target(3, "tandem scale asked for 3")
    assert parent.target == 1 and "no generation run is added once restarts are spent" in caplog.text


def test_scaling_down_retires_the_highest_id_and_scaling_up_skips_a_retiring_one(file_store):
    parent = parent_of(file_store, max_lag=1, restarts=1)
    child(parent, "gen0", Running())
    child(parent, "gen1", Running())
    retiring = parent.generators["gen1"]
    parent.scale_to(1)
    assert list(parent.generators) == ["gen0"] and parent.retiring == {"gen1": retiring}
    assert retire_requested(file_store, "gen1") and not retire_requested(file_store, "gen0")
    parent.scale_to(2)
    assert parent.started == ["gen2"], "gen1's id is still its retiring run's"


@pytest.mark.parametrize("claimed", [0, 2])
def test_scaling_down_cancels_a_run_no_worker_has_taken_unless_it_has_claims_to_finish(file_store, claimed):
    """Retired, a run still waiting for a worker booted its engines only to leave (minutes of
    GPUs with SGLang); one restarted with its earlier life's claims must run to finish them."""
    parent = parent_of(file_store, max_lag=1, restarts=1)
    child(parent, "gen0", Running())
    child(parent, "gen1", Scheduled())
    claim_slots(file_store, "gen1", claimed)
    waiting = parent.generators["gen1"]
    parent.scale_to(1)
    assert parent.retiring == {"gen1": waiting} and retire_requested(file_store, "gen1")
    assert parent.client.states[waiting].type == (StateType.CANCELLED if not claimed else StateType.SCHEDULED)
    parent.scale_to(1)
    assert parent.retiring == ({} if not claimed else {"gen1": waiting}) and parent.started == []


@pytest.mark.parametrize("done", [False, True])
def test_a_generator_that_completes_as_training_ends_is_not_replaced(file_store, done):
    """A generation run completes when it sees the trainer done, which the parent may see before
    the training run's own end: it started another, which booted its engines and left."""
    parent = parent_of(file_store, max_lag=1, restarts=1)
    child(parent, "gen0", Completed())
    publish_trainer_state(file_store, TrainerState(version=4, done=done))
    parent.restart_failed_generators()
    parent.scale_to(1)
    assert parent.generators.keys() == (set() if done else {"gen0"}) and parent.started == ([] if done else ["gen0"])


@pytest.mark.parametrize("claimed, stops", [(0, False), (PER_STEP + 1, True)])
def test_a_retiring_generator_that_ends_with_claims_left_is_counted_as_given_up(file_store, claimed, stops):
    """A retiring generator that leaves Completed with slots still claimed: no run of its id
    comes back for them, and the parent dropped it without counting them: past what the lag
    window spares, the trainer waited for good, unexplained."""
    parent = parent_of(file_store, max_lag=1, restarts=1)
    child(parent, "gen0", Running())
    child(parent, "gen1", Completed(), retiring=True)
    claim_slots(file_store, "gen1", claimed)
    parent.scale_to(1)
    assert parent.retiring == {} and sum(parent.abandoned.values()) == claimed
    reason = stop_reason(file_store)
    assert (reason is not None) == stops
    if stops:
        assert f"retiring generation gen1 left {claimed} claimed groups" in reason


def test_a_retired_generators_left_claims_stop_counting_once_its_id_runs_again(file_store, monkeypatch):
    """Scaling up reuses the lowest free id, whose new run generates its earlier life's claims
    first: counted for good, each retirement that left a few added to a total that stopped a
    healthy run once past the lag window's spare."""
    monkeypatch.setattr(supervisor, "run_deployment", lambda name, **_: SimpleNamespace(id=uuid4(), name=name, state=Running()))
    parent = parent_of(file_store, max_lag=1, restarts=1)
    del parent.start  # the real one, over the Prefect call above
    parent.claim, parent.parameters, parent.started = "c1", {}, Counter()
    child(parent, "gen0", Running())
    child(parent, "gen1", Completed(), retiring=True)
    claim_slots(file_store, "gen1", 2)
    parent.scale_to(1)
    assert parent.abandoned == {"gen1": 2}
    parent.scale_to(2)
    assert "gen1" in parent.generators and parent.abandoned == {}, "a run of gen1 generates them again"


def test_claims_whose_groups_were_set_aside_are_not_a_given_up_generators_unfinished_work(file_store):
    """Their groups were counted lost and replaced: taken for unfinished claims, a generator whose
    environment had failed enough groups stopped a healthy run when it was given up on."""
    parent = parent_of(file_store, max_lag=1, restarts=0)
    claim_slots(file_store, "gen1", PER_STEP + 1)
    for slot in SlotClaims(file_store, "gen1", PER_STEP).claimed_by_me():
        set_aside_group(file_store, slot, {"error": "the environment failed it"})
    child(parent, "gen0", Running())
    child(parent, "gen1", Failed(message="boom"))
    parent.restart_failed_generators()
    assert parent.gave_up and stop_reason(file_store) is None and parent.unfinished_claims("gen1") == []


def test_a_retiring_generator_that_dies_is_started_again_to_finish_its_claims(file_store):
    parent = parent_of(file_store, max_lag=0, restarts=1)
    request_retire(file_store, "gen1")
    claim_slots(file_store, "gen1", 1)
    child(parent, "gen0", Running())
    child(parent, "gen1", Failed(message="boom"), retiring=True)
    parent.scale_to(1)
    assert parent.started == ["gen1"] and "gen1" in parent.retiring and parent.restarts == 1
    assert retire_requested(file_store, "gen1"), "it comes back to finish, not to stay"
    parent.client.states[parent.retiring["gen1"]] = Failed(message="again")
    parent.scale_to(1)
    assert "gen1" not in parent.retiring and "1 groups" in stop_reason(file_store), "max_lag 0 spares none"
    assert parent.gave_up, "its id is not reused by a scale-up, which would get round the restarts"


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_retiring_generator_that_ends_after_its_last_commit_is_neither_restarted_nor_given_up_on(file_store, restarts):
    """Cancelled in the UI, or crashed in its teardown, after committing every group it claimed:
    a restart booted engines to do nothing and was charged; with none left, the give-up ignored
    every later scale-up."""
    parent = parent_of(file_store, max_lag=1, restarts=restarts)
    request_retire(file_store, "gen1")
    child(parent, "gen0", Running())
    child(parent, "gen1", Failed(message="cancelled in teardown"), retiring=True)
    parent.target = 1
    parent.scale_to(1)
    assert parent.started == [] and parent.retiring == {} and parent.restarts == 0 and not parent.gave_up
    parent.scale_to(2)
    assert parent.started == ["gen1"], "a scale-up still adds a generation run"


def test_a_restart_the_api_refused_is_not_charged_and_is_tried_again(file_store):
    parent = parent_of(file_store, max_lag=1, restarts=1)
    child(parent, "gen0", Failed(message="boom"))
    refused = [httpx.ConnectError("refused")]

    def start(flow_name, **parameters):
        if refused:
            raise refused.pop()
        return SimpleNamespace(id=uuid4(), name=flow_name, state=Running())

    parent.start = start
    with pytest.raises(httpx.ConnectError):
        parent.restart_failed_generators()
    assert parent.restarts == 0
    parent.restart_failed_generators()
    assert parent.restarts == 1 and not parent.gave_up


def test_child_starts_carry_a_key_that_a_resent_creation_repeats(monkeypatch):
    """Prefect's client resends a creation whose answer it lost; the server makes one run per key."""
    keys, names, failures = [], [], [httpx.ReadTimeout("lost answer")]

    def run_deployment(name, parameters, as_subflow, timeout, idempotency_key, flow_run_name):
        keys.append(idempotency_key)
        if failures:
            raise failures.pop()
        names.append(flow_run_name)
        return SimpleNamespace(id=uuid4(), name=flow_run_name, state=Running())

    monkeypatch.setattr(supervisor, "run_deployment", run_deployment)
    parent = Supervisor.__new__(Supervisor)
    parent.config, parent.log, parent.parameters = RunConfig(run_id="demo"), logging.getLogger("test"), {}
    parent.claim, parent.started, parent.abandoned = "c1", Counter(), {}
    with pytest.raises(httpx.ReadTimeout):
        parent.start("training")
    parent.start("training")
    parent.start("generation", producer="gen0")
    parent.start("generation", producer="gen0")
    parent.start("training")
    assert keys == ["tandem:c1:training:0", "tandem:c1:training:0", "tandem:c1:gen0:0", "tandem:c1:gen0:1", "tandem:c1:training:1"]
    assert names == ["demo-training", "demo-gen0", "demo-gen0-2", "demo-training-2"], "the UI's runs say which is which"


def test_draining_cancels_a_child_no_worker_picked_up_outright_and_asks_a_running_ones_worker(file_store):
    """Cancelling is for a worker to act on: a run still Scheduled stayed Cancelling in the UI with
    no worker polling its pool, and the parent waited out its cancel wait for it."""
    parent = parent_of(file_store, max_lag=1, restarts=1)
    parent.training = None
    child(parent, "gen0", Scheduled())
    child(parent, "gen1", Running())
    asked = {}
    parent.client.set_flow_run_state = lambda run_id, state, force=False: asked.update({run_id: state.type})
    parent.drain(seconds=0, cancel_wait=0)
    assert asked == {parent.generators["gen0"]: StateType.CANCELLED, parent.generators["gen1"]: StateType.CANCELLING}


def test_a_parent_being_cancelled_waits_for_its_children_less_than_its_worker_gives_it(file_store, monkeypatch):
    """Its worker SIGKILLs a cancelled parent 30 s after the SIGTERM; the parent's own cleanup
    (the lease's release) comes after this wait, so the wait must end well before that."""
    monkeypatch.setattr(supervisor, "CANCEL_WAIT_SECONDS", 60.0)
    monkeypatch.setattr(supervisor, "TERMINATED_CANCEL_WAIT_SECONDS", 0.2)
    monkeypatch.setattr(supervisor, "clear_scale_request", lambda run_id: None)
    parent = parent_of(file_store, max_lag=1, restarts=1)
    parent.pipeline = SimpleNamespace(gone=lambda now=False: None, successor=None)
    parent.client.set_flow_run_state = lambda run_id, state, force=False: None  # the children never get there
    parent.target, parent.training = 1, None

    def terminated():
        raise supervisor.TerminationSignal(15)

    parent.watch = terminated
    started = time.monotonic()
    with pytest.raises(supervisor.TerminationSignal):
        parent.run()
    assert time.monotonic() - started < 5, "not CANCEL_WAIT_SECONDS"
    assert parent.started == ["training", "gen0"] and "the pipeline failed" in stop_reason(file_store)


def test_a_child_that_waits_long_to_start_is_reported_once_naming_its_pool(file_store, monkeypatch, caplog):
    """Nothing else says why a run does not move when no worker of a pool has a free slot."""
    monkeypatch.setattr(supervisor, "START_WARNING_SECONDS", 0.0)
    parent = parent_of(file_store, max_lag=1, restarts=1)
    child(parent, "gen0", Scheduled())
    with caplog.at_level(logging.WARNING, logger="test"):
        for _ in range(3):
            parent.state_of(parent.generators["gen0"])
    (warning,) = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert "pool 'training'" in warning and "Scheduled" in warning


def test_a_scale_request_repeated_after_autoscale_moved_the_run_is_taken_again(file_store, monkeypatch, caplog):
    """`tandem scale demo --generators 3` twice, autoscale having moved the run to 2 between
    them: the second request is news (it carries its own time), and one past autoscale.max is
    bounded at once, saying so."""
    variable: dict = {}
    monkeypatch.setattr(supervisor, "Variable", SimpleNamespace(get=lambda name, default=None: variable.get("value", default)))
    parent = parent_of(file_store, max_lag=1, restarts=0)
    parent.config = RunConfig.model_validate({"prefect": {"autoscale": {"min": 1, "max": 4, "cooldown_seconds": 3600}}})
    parent.target, parent.last_request, parent.changed_at = 1, None, time.monotonic()
    assert parent.wanted_generators() == 1, "no request yet"
    variable["value"] = {"generators": 3, "requested_at": 1000.0}
    assert parent.wanted_generators() == 3
    parent.set_target(2, "autoscale: generators waiting")
    assert parent.wanted_generators() == 2, "the same request, seen already"
    variable["value"] = {"generators": 3, "requested_at": 1060.0}
    assert parent.wanted_generators() == 3, "a new request for the same count"
    variable["value"] = scale_request(9)
    with caplog.at_level(logging.INFO, logger="test"):
        assert parent.wanted_generators() == 4
    assert "generation runs: 3 -> 4 (tandem scale asked for 9, bounded to 1-4 by prefect.autoscale)" in caplog.text


@pytest.mark.parametrize("request_value, target", [
    ({"generators": 0, "requested_at": 1.0}, 1), ({"generators": 300, "requested_at": 1.0}, 256),
    (2, 2), ("3", 3), ({"generators": "many"}, 5), (True, 5), ([2], 5),
])  # fmt: skip
def test_a_scale_request_without_autoscale_is_bounded_and_one_of_another_form_ignored(file_store, monkeypatch, request_value, target):
    """A request can come from the Prefect UI or API, not only the CLI: a count out of range is
    bounded, a bare number (as earlier CLIs wrote it) taken, anything else ignored."""
    monkeypatch.setattr(supervisor, "Variable", SimpleNamespace(get=lambda name, default=None: request_value))
    parent = parent_of(file_store, max_lag=1, restarts=0)
    parent.target, parent.last_request, parent.changed_at = 5, None, time.monotonic()
    assert parent.wanted_generators() == target


def test_tandem_scale_reads_the_config_of_the_run_it_asks():
    """`tandem scale` finds the run by its config's run id and reads its mode and autoscale
    bounds: the config parameter, or configs/deployed.yaml's (deployed, no autoscale) when it was
    started without one, under its run_id parameter if given, as the pipeline resolves them."""
    bounded = RunConfig.model_validate({"prefect": {"mode": "deployed", "autoscale": {"min": 2, "max": 5}}})
    assert pipeline_config({"config": bounded.as_parameters(secrets=False)}).prefect.autoscale == bounded.prefect.autoscale
    partial = pipeline_config({"config": {"prefect": {"mode": "deployed", "autoscale": {"max": 3}}}}).prefect.autoscale
    assert (partial.min, partial.max, partial.cooldown_seconds) == (1, 3, 30.0), "defaults filled in, as the run does"
    default = pipeline_config({"run_id": "demo"})
    assert (default.run_id, default.prefect.mode, default.prefect.autoscale) == ("demo", "deployed", None)
    renamed = pipeline_config({"config": RunConfig(run_id="given").as_parameters(secrets=False), "run_id": "over"})
    assert (renamed.run_id, renamed.prefect.mode) == ("over", "local")
    assert pipeline_config({"config": {"prefect": {"mode": "elsewhere"}}}) is None
    stored = RunConfig.model_validate({"run_id": "keyed", "engine": {"api_key": "k"}}).model_dump(mode="json")
    assert stored["engine"]["api_key"] == "**********", "as the server keeps a `tandem run` pipeline's parameters"
    assert pipeline_config({"config": stored}).engine.api_key is None, "the mask read as unset, not refused"


def test_a_cancelled_generator_is_one_fewer_not_a_crash(file_store):
    """Cancelled in the UI while another generates: the target drops by one and nothing is
    charged. Its claims need a run of its id, so it comes back (retiring) to finish them; one
    with none left is simply gone; the last one is restarted, as a crashed one is."""
    parent = parent_of(file_store, max_lag=1, restarts=3)
    parent.target, parent.changed_at = 3, time.monotonic()
    claim_slots(file_store, "gen1", 2)
    child(parent, "gen0", Running())
    child(parent, "gen1", Cancelled())
    child(parent, "gen2", Cancelled())
    parent.restart_failed_generators()
    assert parent.target == 1 and list(parent.generators) == ["gen0"] and parent.restarts == 0
    assert parent.started == ["gen1"] and list(parent.retiring) == ["gen1"], "back to finish its two groups"
    assert retire_requested(file_store, "gen1") and retire_requested(file_store, "gen2"), "...and leave"
    parent.scale_to(1)
    assert parent.started == ["gen1"], "gen2 claimed nothing: nothing to come back for"
    parent.client.states[parent.generators["gen0"]] = Cancelled()
    parent.restart_failed_generators()
    assert parent.started == ["gen1", "gen0"] and parent.restarts == 1, "the last one is restarted"


def test_a_generator_cancelled_at_autoscales_min_is_restarted_as_a_crashed_one(file_store):
    parent = parent_of(file_store, max_lag=1, restarts=3)
    parent.config = RunConfig.model_validate({"prefect": {"autoscale": {"min": 2, "max": 4}}})
    parent.target, parent.changed_at = 2, time.monotonic()
    child(parent, "gen0", Running())
    child(parent, "gen1", Cancelled())
    parent.restart_failed_generators()
    assert parent.target == 2 and parent.started == ["gen1"] and parent.restarts == 1 and "gen1" in parent.generators
    assert not retire_requested(file_store, "gen1")


def test_the_last_generator_cancelled_after_a_give_up_stops_the_run(file_store):
    """Out of restarts, one of two generators given up on (the target still says 2): the other,
    cancelled in the UI, was taken for one fewer of two, and the run went on with none, the
    trainer waiting for ever. It is the last one alive: a give-up, which stops the run."""
    parent = parent_of(file_store, max_lag=1, restarts=0)
    parent.target, parent.changed_at = 2, time.monotonic()
    child(parent, "gen0", Running())
    child(parent, "gen1", Failed(message="boom"))
    parent.restart_failed_generators()
    assert parent.gave_up and stop_reason(file_store) is None, "gen0 goes on alone"
    parent.client.states[parent.generators["gen0"]] = Cancelled()
    parent.restart_failed_generators()
    assert parent.generators == {} and parent.started == []
    assert "every generation run failed; the last, gen0, ended" in stop_reason(file_store)


def test_autoscale_waits_for_a_generator_it_started_to_bring_its_engines_up(file_store, monkeypatch):
    """A trainer that waits asks for one more generation run each cooldown; a run started is no
    help until its engines are up (minutes for SGLang), and before, the parent kept adding runs
    on the same measurement until the maximum."""
    monkeypatch.setattr(supervisor, "Variable", SimpleNamespace(get=lambda name, default=None: default))
    parent = parent_of(file_store, max_lag=1, restarts=0)
    parent.config = RunConfig.model_validate({"prefect": {"autoscale": {"min": 1, "max": 4, "cooldown_seconds": 0}}})
    parent.target, parent.last_request, parent.changed_at = 1, None, time.monotonic() - 1
    trainer, gen0 = MetricsLog(file_store, "trainer", flush_seconds=0), MetricsLog(file_store, "generator-gen0", flush_seconds=0)
    gen0.log("engines_started", version=0)
    parent.start_generator("gen0")
    gen0.log("engines_started", version=0)  # gen0's run is up

    def trainer_waits() -> None:  # three steps, each begun after the last change
        for _ in range(3):
            trainer.log("train_step", wait_seconds=3.0, step_seconds=1.0, time=time.time() + 5)

    trainer_waits()
    assert parent.wanted_generators() == 2, "the trainer waits: one more"
    parent.scale_to(2)
    assert parent.started == ["gen0", "gen1"] and parent.still_starting() == ["gen1"]
    trainer_waits()
    assert parent.wanted_generators() == 2, "gen1 is still starting: not another one yet"
    MetricsLog(file_store, "generator-gen1", flush_seconds=0).log("engines_started", version=1)
    assert parent.still_starting() == []
    assert parent.wanted_generators() == 3, "gen1 is up and the trainer still waits"
    parent.scale_to(3)
    monkeypatch.setattr(supervisor, "BOOT_WAIT_SECONDS", 0.0)
    trainer_waits()
    assert parent.still_starting() == [] and parent.wanted_generators() == 4, "gen2 found no worker: it holds nothing for good"


def test_a_generator_still_starting_does_not_hold_a_retire(file_store, monkeypatch):
    monkeypatch.setattr(supervisor, "Variable", SimpleNamespace(get=lambda name, default=None: default))
    parent = parent_of(file_store, max_lag=1, restarts=0)
    parent.config = RunConfig.model_validate({"prefect": {"autoscale": {"min": 1, "max": 4, "cooldown_seconds": 0}}})
    parent.target, parent.last_request, parent.changed_at = 2, None, time.monotonic() - 1
    parent.start_generator("gen0")
    parent.start_generator("gen1")  # neither has its engines up
    for producer in ("gen0", "gen1"):
        MetricsLog(file_store, f"generator-{producer}", flush_seconds=0).log("load", idle_fraction=0.95, time=time.time() + 5)
    trainer = MetricsLog(file_store, "trainer", flush_seconds=0)
    for _ in range(2):  # the trainer's idle share, measured since the last change: it does not wait
        trainer.log("train_step", wait_seconds=0.0, step_seconds=1.0, time=time.time() + 5)
    assert parent.still_starting() == ["gen0", "gen1"] and parent.wanted_generators() == 1


@flow(name="pipeline")
def _pipeline_started_in_this_process(run_id: str) -> dict:
    """A pipeline called in this process, as `tandem run` calls it in deployed mode: no deployment
    gave it RUN_TAG. Then what its start clears of the run's scale requests."""
    found = {"before tagging": running_pipeline(run_id) is not None}
    tag_for_scaling(prefect_flow_run.get_id())
    found["after"] = running_pipeline(run_id) is not None
    name = scale_variable(run_id)
    for made_for in ("an earlier pipeline run", prefect_flow_run.get_id()):
        Variable.set(name, scale_request(3, made_for), overwrite=True)
        clear_scale_request(run_id, unless_for=prefect_flow_run.get_id())
        found[made_for == prefect_flow_run.get_id()] = Variable.get(name, default=None) is not None
    return found


@pytest.mark.slow  # a temporary Prefect server
def test_tandem_scale_reaches_a_pipeline_that_was_not_started_from_a_deployment_even_as_it_starts():
    """A request made between the pipeline's start and its clearing of earlier ones is kept."""
    with prefect_test_harness():
        found = _pipeline_started_in_this_process("called")
    assert found == {"before tagging": False, "after": True, False: False, True: True}
