"""Run configuration: pydantic models (`RunConfig` in schema.py, one per section in
sections.py), the field types they share (fields.py), YAML loading with overrides (loader.py),
and the shipped YAML files (tiny.yaml is the embedded default, deployed.yaml the default of the
`pipeline` deployment). Imports nothing else of tandem."""

from pathlib import Path

from configs.loader import ConfigError, load_config
from configs.schema import RunConfig

CONFIG_DIR = Path(__file__).parent
TINY_CONFIG = CONFIG_DIR / "tiny.yaml"
DEPLOYED_CONFIG = CONFIG_DIR / "deployed.yaml"

__all__ = ["CONFIG_DIR", "DEPLOYED_CONFIG", "TINY_CONFIG", "ConfigError", "RunConfig", "load_config"]
