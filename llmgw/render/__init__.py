"""Rendering a config Snapshot into Envoy's bootstrap, by reason to change; llmgw/render/bootstrap.py
assembles it."""
