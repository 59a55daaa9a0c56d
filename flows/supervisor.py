"""Deployed mode's parent: the children run as deployment runs on their work pools, watched.

`Supervisor.run` starts one `training` run (pool `training`) and `prefect.generators` `generation`
runs (pool `inference`) with `run_deployment(..., as_subflow=True)`, so the UI shows them under
the pipeline run, and then watches them every `prefect.watch_seconds` until training is over:

- a generation run that crashed or failed is started again with the same producer id (which
  makes it regenerate the slots its earlier life claimed but never committed), at most
  `prefect.generation_restarts` times over the whole run; one cancelled while the run may have
  fewer is taken as one fewer (`Supervisor.take_cancelled`);
- the number of generation runs follows the Prefect variable `tandem scale` sets
  (flows/scaling.py) and, with `prefect.autoscale`, the run's own measurements
  (tasks/autoscale.py): a new run joins by reading LATEST and the admission state from storage,
  and a removed one is asked to retire (tasks/lag.py `request_retire`), which lets it commit
  every slot it claimed before it exits;
- when training ends the generators stop by themselves (the trainer state says done); any
  still running after `DRAIN_SECONDS` is cancelled. If training failed, or the parent itself
  fails or is cancelled, it asks the trainer to stop through storage and cancels every child
  still running, and waits until they are (`CANCEL_WAIT_SECONDS`, less when the parent is itself
  being cancelled), so that no generation run (and none of its engines) outlives the run. A cancellation needs the API; the stop request and the lease do not: a
  child whose pipeline died or released the run stops by itself (tasks/lease.py
  `PipelineWatch`).

The parent only watches: its children need nothing from it to make progress (they meet in the
run directory), and nothing from the Prefect server but their own state reports, which Prefect's
client retries. So a Prefect server that is away for a while (restarted, upgraded) must not end
the run. Prefect's client already retries a request for about a minute (PREFECT_CLIENT_MAX_RETRIES
with exponential backoff); a look at the children that still fails for lack of the API is
logged and tried again at the next watch, for up to `API_OUTAGE_SECONDS` in a row. Only then, or
on any other error, does the parent give up (and cancel its children, as on every failure).
Without this, a look that failed because the server was away for longer than the client's
retries raised out of the watch loop, and the parent cancelled a healthy training run and its
generators and failed the run.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.exceptions import TerminationSignal
from prefect.logging import get_run_logger
from prefect.states import Cancelled, Cancelling
from prefect.variables import Variable

from configs.fields import MAX_GENERATION_RUNS
from configs.schema import RunConfig
from flows.scaling import clear_scale_request, initial_generation_runs, requested_count, scale_variable
from flows.ui import api_unavailable
from infra.deployments import UNRESPONSIVE_MESSAGE
from infra.storage import StorageUnavailable, open_run_store
from tasks.autoscale import autoscale_target, generator_wait_fraction, trainer_idle_fraction
from tasks.lag import SlotClaims, live_producers, read_trainer_state, request_retire, request_stop, stop_reason, withdraw_retire
from tasks.lease import PipelineWatch
from tasks.metrics import MetricsTail
from tasks.failed_groups import spent_slots

DRAIN_SECONDS = 60.0
"""How long generation runs get to stop by themselves once training has ended."""


CANCEL_WAIT_SECONDS = 60.0
"""How long the parent waits for the children it cancelled to be stopped (their worker kills the
flow run's process; its engines, in sessions of their own, stop when they see it gone) before it
reports them and ends anyway."""
TERMINATED_CANCEL_WAIT_SECONDS = 15.0
"""The same wait when the parent itself is being cancelled: its worker SIGKILLs it 30 s after
the SIGTERM, and what follows the wait (the lease's release, the scale request's) must run
before that, or the run stays held, and refused to a new pipeline, until the lease goes stale."""


BOOT_WAIT_SECONDS = 900.0
"""Longest a started generation run holds autoscale's additions while its engines come up: an
SGLang engine's first start may take that long (infra/engines/sglang.py start_timeout)."""
START_WARNING_SECONDS = 120.0
"""How long a child run may wait for a worker before the parent says so: about ten times a
start's usual few seconds, and nothing else would tell the user why the run does not move."""


API_OUTAGE_SECONDS = 600.0
"""How long the parent keeps watching through a Prefect API that does not answer (each look
itself already retried for about a minute by Prefect's client) before it gives up on the run."""


class ChildRunFailed(RuntimeError):
    """A child run of the pipeline ended in a state other than Completed."""


def _marked_unresponsive(state) -> bool:
    """Crashed by the automation `tandem deploy` adds, for heartbeats that stopped arriving."""
    prefix = UNRESPONSIVE_MESSAGE.split("{", 1)[0]
    return state.is_crashed() and (state.message or "").startswith(prefix)


def _ended(state) -> str:
    """A final state for a person: its name and Prefect's message, which names the exception."""
    message = " ".join((state.message or "").split())
    return f"{state.name} ({message[:400]})" if message else state.name


def _share(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"


class Supervisor:
    """The child runs of one deployed pipeline run, and what the parent does about them."""

    def __init__(self, config: RunConfig, claim: str):
        self.config = config
        self.store = open_run_store(config.storage, config.run_id)
        self.client = get_client(sync_client=True)
        self.log = get_run_logger()
        self.parameters = {"config": config.as_parameters(secrets=True), "pipeline_claim": claim}
        self.claim = claim
        self.started: Counter[str] = Counter()
        """Child runs started, by role ("training" or the producer id)."""
        self.training: FlowRun | None = None
        self.generators: dict[str, UUID] = {}
        """Producer id -> flow run id of each generation run that should be generating."""
        self.retiring: dict[str, UUID] = {}
        """Producer id -> flow run id of each generation run asked to retire, until it is final."""
        self.restarts = 0
        self.abandoned: dict[str, int] = {}
        """Producer id -> the slots it claimed and no run of it will commit (a run given up on, a
        retiring one that left some); forgotten when a run of that id starts again, which
        generates them first."""
        self.gave_up = False
        """Set once a generation run failed with no restarts left: from then on the parent starts
        no generation run, so that a scale request or the autoscaler cannot undo the bound."""
        self.target = initial_generation_runs(config)
        """How many generation runs the parent is steering towards."""
        self.last_request: dict | None = None
        """The `tandem scale` request (`scale_request`) taken last."""
        self.changed_at = time.monotonic()
        self.waiting_since: dict[UUID, float] = {}
        """When each child run was first seen waiting to start."""
        self.warned_waiting: set[UUID] = set()
        self.outage_since: float | None = None
        """When the Prefect API stopped answering the watch loop; None while it answers."""
        self.pipeline = PipelineWatch(self.store, claim)
        """This pipeline's hold on the run (it holds the lease while the supervisor runs)."""
        self.metrics: dict[str, MetricsTail] = {}
        """Component -> its metrics file, read as it grows (autoscale looks every watch)."""
        self.booting: dict[str, tuple[int, float]] = {}
        """Producer -> `engines_started` records its metrics held when its run was started, and
        when: until there is one more, the run is still starting (a worker's pickup, an engine's
        boot), for BOOT_WAIT_SECONDS at most."""

    def start(self, flow_name: str, **parameters) -> FlowRun:
        """Start a child run. Its idempotency key names this pipeline's claim, the child's role
        and how many of that role it started before: Prefect's client resends a creation whose
        answer it lost (a read timeout, a server restarting), and without the key the server
        made a second run, two trainers on one run directory.

        The run is named after the run and its role ("demo-training", "demo-gen1", a restart
        "demo-gen1-2"), so that the UI's list of runs says which is which, as the logs do."""
        name = f"{flow_name}/{self.config.prefect.deployment}"
        role = parameters.get("producer", flow_name)
        key = f"tandem:{self.claim}:{role}:{self.started[role]}"
        run_name = f"{self.config.run_id}-{role}" + (f"-{self.started[role] + 1}" if self.started[role] else "")
        run = run_deployment(
            name, parameters=self.parameters | parameters, as_subflow=True, timeout=0, idempotency_key=key, flow_run_name=run_name
        )  # fmt: skip
        self.started[role] += 1  # after the run exists: a start that raised is tried again with its key
        self.abandoned.pop(role, None)
        self.log.info("started %s run %s", flow_name, run.name)
        return run

    def start_generator(self, producer: str) -> None:
        withdraw_retire(self.store, producer)
        self.generators[producer] = self.start("generation", producer=producer).id
        self.booting[producer] = (self._engine_starts(producer), time.monotonic())

    def _records(self, component: str) -> list[dict]:
        return self.metrics.setdefault(component, MetricsTail(self.store, component)).records()

    def _engine_starts(self, producer: str) -> int:
        return sum(r["event"] == "engines_started" for r in self._records(f"generator-{producer}"))

    def still_starting(self) -> list[str]:
        """Generation runs started that have not yet brought their engines up. Autoscale adds
        none while one is starting: until then the trainer's idle share says nothing of what it
        will add, and with SGLang's minutes of boot the parent added a run every cooldown up to
        the maximum. A run that has not started within BOOT_WAIT_SECONDS (no worker free for it)
        no longer holds scaling up."""
        for producer, (before, since) in list(self.booting.items()):
            if producer not in self.generators or time.monotonic() - since > BOOT_WAIT_SECONDS or self._engine_starts(producer) > before:
                del self.booting[producer]
        return sorted(self.booting)

    def run(self) -> None:
        """Start the children and watch them until training is over; raise if it failed. The
        run's `tandem scale` request is cleared at the end (the pipeline cleared it as it took
        the run), so that a retrain of the run starts with `prefect.generators`."""
        try:  # a start that fails stops those already started
            self.training = self.start("training")
            self.training_state = self.training.state
            for i in range(self.target):
                self.start_generator(f"gen{i}")
            while not (state := self.watch()).is_final():
                time.sleep(self.config.prefect.watch_seconds)
            if not state.is_completed():
                self.stop_children(f"training run {self.training.name} ended {state.name}")
            self.drain(DRAIN_SECONDS if state.is_completed() else 0.0)
        except BaseException as err:
            self.stop_children(f"the pipeline failed: {err!r}")
            self.drain(0.0, TERMINATED_CANCEL_WAIT_SECONDS if isinstance(err, TerminationSignal) else None)
            raise
        finally:
            with contextlib.suppress(Exception):  # the API may be what failed the run
                clear_scale_request(self.config.run_id)
        if not state.is_completed():
            raise ChildRunFailed(f"training run {self.training.name} ended {state.name}: {state.message or ''}".strip())

    def stop_children(self, reason: str) -> None:
        """Ask the trainer to stop through storage, which the children read without the Prefect
        API (that may be what failed): it marks itself done, on which the generators leave. A
        trainer marked Crashed for lost heartbeats may still be training, and a cancellation
        cannot reach children while the API is away. Not once another pipeline has taken the
        run over: the stop would be its trainer's."""
        self.pipeline.gone(now=True)
        if self.pipeline.successor is not None:
            self.log.error("not stopping the children through storage: %s", self.pipeline.reason)
            return
        try:
            if stop_reason(self.store) is None:  # the first cause is the one to keep
                request_stop(self.store, reason)
        except Exception as err:  # the failure being handled matters more; the children see the lease go
            self.log.error("could not ask the children to stop through storage: %r", err)

    def watch(self):
        """One look at the children: restart failed generators, follow the wanted count; returns
        the training run's state. While the Prefect API or the run's storage is unavailable it
        returns the state last seen (not final), so the loop looks again, until
        `API_OUTAGE_SECONDS` without an answer.
        A pipeline that another has taken the run from (it stalled past its lease) gives up."""
        if self.pipeline.gone() and self.pipeline.successor is not None:
            raise ChildRunFailed(f"this pipeline no longer holds the run: {self.pipeline.reason}")
        try:
            state = self.state_of(self.training.id)
            if not state.is_final():
                self.restart_failed_generators()
                self.scale_to(self.wanted_generators())
        except Exception as err:
            # The run's storage too: the look reads it (metrics for autoscale, claims and retire
            # requests for restarts), and the children ride out its outages, so the parent does.
            away = "the Prefect API" if api_unavailable(err) else "the run's storage" if isinstance(err, StorageUnavailable) else None
            if away is None:
                raise
            now = time.monotonic()
            if self.outage_since is None:
                self.outage_since = now
                self.log.warning("%s is unavailable (%r); the children keep running, watching again", away, err)
            elif now - self.outage_since > API_OUTAGE_SECONDS:
                raise ChildRunFailed(f"{away} has been unavailable for {now - self.outage_since:.0f} s: {err!r}") from err
            return self.training_state
        if self.outage_since is not None:
            self.log.info("the Prefect API and the run's storage answer again after %.0f s", time.monotonic() - self.outage_since)
            self.outage_since = None
        self.training_state = state
        return state

    def state_of(self, run_id: UUID):
        """Run `run_id`'s state; warns once about a run that has waited `START_WARNING_SECONDS`
        for a worker to start it."""
        run = self.client.read_flow_run(run_id)
        if run.state.type in (StateType.SCHEDULED, StateType.PENDING) and run_id not in self.warned_waiting:
            waiting_since = self.waiting_since.setdefault(run_id, time.monotonic())
            if time.monotonic() - waiting_since >= START_WARNING_SECONDS:
                self.warned_waiting.add(run_id)
                self.log.warning(
                    "child run %s has waited %.0f s to start (%s): is a worker of pool %r running, with a free slot?",
                    run.name, START_WARNING_SECONDS, run.state.name, run.work_pool_name,
                )  # fmt: skip
        return run.state

    def is_final(self, run_id: UUID) -> bool:
        """Whether run `run_id` is final; False while the API cannot say (drain looks again)."""
        try:
            return self.state_of(run_id).is_final()
        except Exception as err:
            if api_unavailable(err):
                return False
            raise

    def restart_failed_generators(self) -> None:
        for producer, run_id in list(self.generators.items()):
            state = self.state_of(run_id)
            if not state.is_final() or state.is_completed():
                if state.is_completed():
                    del self.generators[producer]
                continue
            if _marked_unresponsive(state) and producer in live_producers(self.store):
                continue  # its heartbeats were lost, not its process: it still writes its record
            if state.is_cancelled() and len(self.generators) > self.generator_bounds()[0]:  # live ones: a given-up one is gone
                self.take_cancelled(producer, run_id)
                continue
            if self.restarts >= self.config.prefect.generation_restarts:
                del self.generators[producer]
                self.give_up(f"generation {producer}", producer, state)
                continue
            self.start_generator(producer)
            self.restarts += 1  # once started: a start the API refused is tried again, not charged twice
            self.log.warning("generation %s ended %s: restarted it (%d of %d)", producer, _ended(state),
                             self.restarts, self.config.prefect.generation_restarts)  # fmt: skip

    def take_cancelled(self, producer: str, run_id: UUID) -> None:
        """A generation run cancelled (the Prefect UI, the API) while the run may have fewer: one
        fewer, as `tandem scale` would have made it, not a crash to start again and charge. Only
        a run of its producer id generates the groups it claimed, so one that left some
        unfinished is started again once, uncharged, with a retire request: it finishes them and
        leaves (cancelled again, the retiring watch restarts it, charged). One cancelled at the
        fewest the run may have (1, or prefect.autoscale.min), counting the runs alive (after a
        give-up the target counts one that is gone), is restarted as a crashed one is: without it
        the trainer would wait, or autoscale's bound break; the run itself stops by cancelling the
        pipeline. With no restarts left that is a give-up, which stops the run if none is left."""
        request_retire(self.store, producer)  # storage first: an outage raised here leaves it to the next watch
        unfinished = self.unfinished_claims(producer)
        del self.generators[producer]
        self.set_target(self.target - 1, f"generation {producer} was cancelled")
        if unfinished:
            self.log.warning("generation %s was cancelled with %d claimed groups unfinished: it comes back to finish them, "
                             "then leaves", producer, len(unfinished))  # fmt: skip
            self.retiring[producer] = run_id  # should the start fail, the retiring watch starts it (and charges it)
            self.retiring[producer] = self.start("generation", producer=producer).id

    def unfinished_claims(self, producer: str) -> list[int]:
        """The slots `producer` claimed and has not committed (nor set aside: tasks/failed_groups.py):
        only a run of its id makes them."""
        claims = SlotClaims(self.store, producer, self.config.training.prompts_per_step)
        return claims.claimed_by_me(exclude=spent_slots(self.store))

    def give_up(self, what: str, producer: str, state) -> None:
        """No more runs of `producer` (out of restarts), nor any new generation run; stop the run
        if none generates any more, or if what it leaves unclaimed starves the trainer."""
        self.gave_up = True
        self.log.error("%s ended %s; no restarts left, and no generation runs will be added", what, state.name)
        if not self.generators:
            request_stop(self.store, f"every generation run failed; the last, {producer}, ended {_ended(state)}")
        elif reason := self.abandon_claims(producer):
            request_stop(self.store, f"{what} ended {_ended(state)} with no restarts left: {reason}")

    def abandon_claims(self, producer: str) -> str | None:
        """Count the slots `producer` claimed and never committed, now that no run of it will;
        the reason the run cannot go on, or None while it can.

        Only a run of the same producer id generates those slots (tasks/generator.py `orphans`),
        so each holds a share of the admission capacity for good: the max_lag + 1 batches in
        flight have max_lag x prompts_per_step slots to spare, and past that no batch fills
        again. The trainer would wait for ever, and the parent with it."""
        per_step, max_lag = self.config.training.prompts_per_step, self.config.lag.max_lag
        self.abandoned[producer] = len(self.unfinished_claims(producer))
        if (abandoned := sum(self.abandoned.values())) <= max_lag * per_step:
            return None
        return (
            f"{abandoned} groups claimed by generation runs given up on will never be generated, more than "
            f"the {max_lag * per_step} the lag window spares (lag.max_lag x training.prompts_per_step), so no batch "
            "could fill again; raise prefect.generation_restarts, or resume the run"
        )

    def wanted_generators(self) -> int:
        """`prefect.generators` at first; then each new count `tandem scale` asks for; and with
        `prefect.autoscale`, one more or one fewer when the run's measurements say so."""
        requested = Variable.get(scale_variable(self.config.run_id), default=None)
        if (count := requested_count(requested)) is not None and requested != self.last_request:
            self.last_request = requested
            low, high = self.generator_bounds()
            bounded = min(max(count, low), high)
            bounds = f", bounded to {low}-{high}{' by prefect.autoscale' if self.config.prefect.autoscale else ''}"
            self.set_target(bounded, f"tandem scale asked for {count}{bounds if bounded != count else ''}")
        policy = self.config.prefect.autoscale
        if policy is not None and time.monotonic() - self.changed_at >= policy.cooldown_seconds:
            since = time.time() - (time.monotonic() - self.changed_at)
            trainer_idle = trainer_idle_fraction(self._records("trainer"), since)
            waits = generator_wait_fraction([self._records(f"generator-{p}") for p in self.generators], since)
            target = autoscale_target(self.target, trainer_idle, waits, policy)
            if target > self.target and self.still_starting():
                target = self.target  # a retire is not held: generators idling say so whatever starts
            if target != self.target:
                self.set_target(target, f"autoscale: trainer idle {_share(trainer_idle)}, generators waiting {_share(waits)}")
        return self.target

    def generator_bounds(self) -> tuple[int, int]:
        """The fewest and most generation runs the run may have: prefect.autoscale's, or 1 to
        MAX_GENERATION_RUNS (a request may come from the Prefect UI, not only the CLI)."""
        policy = self.config.prefect.autoscale
        return (policy.min, policy.max) if policy else (1, MAX_GENERATION_RUNS)

    def set_target(self, target: int, reason: str) -> None:
        """Aim for `target` generation runs. After a give-up no run is added (`scale_to`), so the
        target goes no higher than the runs alive: it drifted up with autoscale and `tandem
        scale`, logged as changes that never came, and held later retires back."""
        if self.gave_up and target > len(self.generators):
            target, reason = len(self.generators), f"{reason}; no generation run is added once restarts are spent"
        if target != self.target:
            self.log.info("generation runs: %d -> %d (%s)", self.target, target, reason)
        else:
            self.log.info("generation runs: %d, unchanged (%s)", target, reason)
        self.target, self.changed_at = target, time.monotonic()

    def scale_to(self, wanted: int) -> None:
        for producer, run_id in list(self.retiring.items()):
            state = self.state_of(run_id)
            if not state.is_final():
                continue
            if state.is_completed():
                # Slots it left claimed and uncommitted (not set aside: tasks/failed_groups.py) hold
                # capacity: no run of its id comes back for them, so they count as a given-up run's do.
                if (unfinished := self.unfinished_claims(producer)) and (reason := self.abandon_claims(producer)):
                    request_stop(self.store, f"retiring generation {producer} left {len(unfinished)} claimed groups: {reason}")
                del self.retiring[producer]
                continue
            if _marked_unresponsive(state) and producer in live_producers(self.store):
                continue  # its heartbeats were lost, not its process: it still finishes its claims
            if not self.unfinished_claims(producer):  # it ended (a cancel, a crash) after its last commit
                del self.retiring[producer]
                self.log.info("retiring generation %s ended %s with every group it claimed committed", producer, _ended(state))
                continue
            # It died before committing what it claimed, which only a run of its name generates:
            # started again with the retire request in place, it does that and leaves.
            if self.restarts < self.config.prefect.generation_restarts:
                self.retiring[producer] = self.start("generation", producer=producer).id
                self.restarts += 1
                self.log.warning("retiring generation %s ended %s: restarted it to finish its claims (%d of %d)",
                                 producer, _ended(state), self.restarts, self.config.prefect.generation_restarts)  # fmt: skip
                continue
            del self.retiring[producer]
            self.give_up(f"retiring generation {producer}", producer, state)
        if len(self.generators) < wanted and not self.gave_up and read_trainer_state(self.store).done:
            return  # its generators complete as they see it: one started now would boot its engines and leave
        while len(self.generators) < wanted and not self.gave_up:
            taken = self.generators.keys() | self.retiring.keys()
            producer = next(f"gen{i}" for i in range(len(taken) + 1) if f"gen{i}" not in taken)
            self.log.info("scaling up to %d generation run(s): starting %s", wanted, producer)
            self.start_generator(producer)
        while len(self.generators) > wanted:
            producer = max(self.generators, key=lambda p: int(p.removeprefix("gen")))
            self.log.info("scaling down to %d generation run(s): retiring %s", wanted, producer)
            request_retire(self.store, producer)
            self.retiring[producer] = run_id = self.generators.pop(producer)
            if self.client.read_flow_run(run_id).state.type == StateType.SCHEDULED and not self.unfinished_claims(producer):
                # No worker has it yet, and it has nothing to finish: it would only boot its engines
                # to leave. Should a worker take it meanwhile, it sees the retire request and leaves.
                self.client.set_flow_run_state(run_id, Cancelled(), force=True)
                self.log.info("%s had not started: cancelled", producer)

    def drain(self, seconds: float, cancel_wait: float | None = None) -> None:
        """Give the generation runs `seconds` to stop by themselves, then cancel what still runs
        and wait up to `cancel_wait` (default CANCEL_WAIT_SECONDS) for it to be stopped."""
        cancel_wait = CANCEL_WAIT_SECONDS if cancel_wait is None else cancel_wait
        runs = [*self.generators.values(), *self.retiring.values()]
        if self.training is not None:
            runs.append(self.training.id)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(self.is_final(r) for r in runs):
            time.sleep(1.0)
        cancelled = [run_id for run_id in runs if not self.is_final(run_id)]
        names = {run_id: str(run_id) for run_id in cancelled}
        for run_id in cancelled:
            try:
                run = self.client.read_flow_run(run_id)
                names[run_id] = run.name
                self.log.warning("cancelling child run %s (%s)", run.name, run.state.name)
                # Cancelling asks the run's worker to stop it; a run no worker has picked up has none
                # to ask, and stayed Cancelling in the UI while the parent waited out cancel_wait.
                self.client.set_flow_run_state(run_id, Cancelled() if run.state.type == StateType.SCHEDULED else Cancelling(), force=True)
            except Exception as err:
                if not api_unavailable(err):
                    raise
                self.log.error("could not cancel child run %s: the Prefect API is unavailable (%r)", names[run_id], err)
        deadline = time.monotonic() + cancel_wait
        while cancelled and time.monotonic() < deadline:
            cancelled = [run_id for run_id in cancelled if not self.is_final(run_id)]
            time.sleep(min(1.0, cancel_wait))
        if cancelled:
            self.log.error("child runs still not cancelled after %.0f s: %s", cancel_wait, ", ".join(names[r] for r in cancelled))
