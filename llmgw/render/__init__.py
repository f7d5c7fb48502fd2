"""Rendering a config Snapshot into Envoy's bootstrap, by reason to change; llmgw/envoy_render.py
assembles it."""
