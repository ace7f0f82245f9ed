"""Configuration: the typed schema, derived values, validation rules and Hydra composition.

The bottom layer of lctrain: it imports no other lctrain package. `validation` and `compose` are
imported by path (`lctrain.config.validation`), so that reading the schema never loads Hydra.
"""

from lctrain.config.derived import Derived, derive, kv_replication, ulysses_degree
from lctrain.config.errors import ConfigError
from lctrain.config.fields import choices_of
from lctrain.config.schema import (
    CheckpointConfig,
    LaunchConfig,
    LctrainConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PlanConfig,
    SlurmConfig,
    TrainConfig,
)
from lctrain.config.schema_data import DataConfig, EvalConfig, MixtureEntry, PreprocessConfig

__all__ = ["CheckpointConfig", "ConfigError", "DataConfig", "Derived", "EvalConfig",
           "LaunchConfig", "LctrainConfig", "LoggingConfig", "MixtureEntry", "ModelConfig",
           "OptimConfig", "ParallelConfig", "PlanConfig", "PreprocessConfig", "SlurmConfig",
           "TrainConfig", "choices_of", "derive", "kv_replication", "ulysses_degree"]
