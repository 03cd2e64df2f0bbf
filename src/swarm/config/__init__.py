"""Configuration: typed sections, one loader, named recipes."""

from swarm.config.agreement import agreed, config_hash, describe_mismatch, model_fingerprint
from swarm.config.loader import load_config, replace, to_toml
from swarm.config.schema import (
    BackupConfig,
    ConfigError,
    ConfigMismatch,
    DataConfig,
    LocalSwarmConfig,
    ModelConfig,
    NetConfig,
    OptimConfig,
    RebalanceConfig,
    ServerConfig,
    SwarmConfig,
    TrainerConfig,
    WireConfig,
)

__all__ = [
    "BackupConfig",
    "ConfigError",
    "ConfigMismatch",
    "DataConfig",
    "LocalSwarmConfig",
    "ModelConfig",
    "NetConfig",
    "OptimConfig",
    "ServerConfig",
    "SwarmConfig",
    "RebalanceConfig",
    "TrainerConfig",
    "WireConfig",
    "agreed",
    "config_hash",
    "describe_mismatch",
    "load_config",
    "model_fingerprint",
    "replace",
    "to_toml",
]
