"""Run configuration: pydantic models (schema.py), YAML loading with overrides (loader.py), and
the shipped YAML files (tiny.yaml is the embedded default). Imports nothing else of tandem."""

from pathlib import Path

from configs.loader import ConfigError, load_config
from configs.schema import RunConfig

CONFIG_DIR = Path(__file__).parent
TINY_CONFIG = CONFIG_DIR / "tiny.yaml"

__all__ = ["CONFIG_DIR", "TINY_CONFIG", "ConfigError", "RunConfig", "load_config"]
