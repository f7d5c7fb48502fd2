"""Configuration: strict schema, a loader that builds one immutable snapshot, and its revision."""

from extproc.config.loader import ConfigError, Snapshot, load_snapshot

__all__ = ["ConfigError", "Snapshot", "load_snapshot"]
