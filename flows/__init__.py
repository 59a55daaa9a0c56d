"""Prefect flows (pipeline, generation, training, evaluation, retrain) and the `tandem` CLI.

Importing the package sets defaults that must be in place before Prefect or transformers is
imported; it is the first tandem import of the CLI, of its engine processes and of
`python -m flows.pipeline`. An environment variable the user set wins; a Prefect profile's
setting (`prefect config set`) does not, since Prefect ranks the environment above profiles: set
those in the environment.
- Hugging Face's progress bars off (a bar for every tiny save and load; tandem draws its own
  progress). A process that imported transformers first (a worker loading a deployment's flow)
  has them turned off by infra/modelfactory.py, which every process that saves or loads a model
  imports.
- The temporary Prefect server of a local run: no analytics, and 120 s to start instead of
  Prefect's 20, which a laptop busy with other work (a run already going) exceeded: `tandem run`
  then failed with "Timed out while attempting to connect to ephemeral Prefect API server".
- tandem's own loggers (`tasks`, `infra`, `flows`: an engine restarted, a shard quarantined,
  storage retrying) also log to the Prefect API, so that their warnings show in the run's logs
  in the UI, not only in the terminal; records from threads outside a run are not sent, and not
  warned about. A deployed run's process has imported Prefect before this package: prefect.yaml
  sets the same for its runs (TANDEM_PREFECT_LOGGING).
"""

import os

EPHEMERAL_SERVER_STARTUP_SECONDS = 120
TANDEM_PREFECT_LOGGING = {"PREFECT_LOGGING_EXTRA_LOGGERS": "tasks,infra,flows", "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore"}

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(EPHEMERAL_SERVER_STARTUP_SECONDS))
for _name, _value in TANDEM_PREFECT_LOGGING.items():
    os.environ.setdefault(_name, _value)
