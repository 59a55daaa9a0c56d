"""Prefect flows (pipeline, generation, training, evaluation, retrain) and the `tandem` CLI.

Importing the package turns transformers' progress bars off (a bar for every tiny save and
load; tandem draws its own progress): the package is the first tandem import of the CLI, of
`python -m flows.pipeline` and of a deployment's flow run.
"""

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
