"""Prefect flows (pipeline, generation, training, evaluation, retrain) and the `tandem` CLI.

Importing the package turns transformers' progress bars off (a bar for every tiny save and
load; tandem draws its own progress). It is the first tandem import of the CLI, of its engine
processes and of `python -m flows.pipeline`; a worker loads a deployment's flow from its file,
after transformers, so set HF_HUB_DISABLE_PROGRESS_BARS=1 in the workers' environment to quiet
their logs.
"""

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
