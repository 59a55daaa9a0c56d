"""Prefect flows (pipeline, generation, training, evaluation, retrain) and the `tandem` CLI.

Importing the package turns Hugging Face's progress bars off before transformers is imported
(a bar for every tiny save and load; tandem draws its own progress). It is the first tandem
import of the CLI, of its engine processes and of `python -m flows.pipeline`; a process that
imported transformers first (a worker loading a deployment's flow) has its bars turned off by
infra/modelfactory.py, which every process that saves or loads a model imports.
"""

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
