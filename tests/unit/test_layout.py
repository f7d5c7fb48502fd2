"""The layout is the architecture: the data plane (extproc/) imports neither the control plane
(llmgw/) nor the simulator (enginesim/), and the simulator knows nothing of the gateway."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT


def imported_packages(package: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        out[str(path.relative_to(ROOT))] = {name.split(".")[0] for name in names}
    return out


@pytest.mark.parametrize(("package", "forbidden"), [
    ("extproc", {"llmgw", "enginesim"}),
    ("enginesim", {"llmgw", "extproc"}),
    # Adapters translate plain values: no Envoy, gRPC or protobuf types (issue 13's shape).
    ("extproc/adapters", {"llmgw", "enginesim", "envoy", "grpc", "google", "xds", "udpa"}),
])
def test_no_forbidden_imports(package: str, forbidden: set[str]) -> None:
    bad = {f: sorted(pkgs & forbidden) for f, pkgs in imported_packages(package).items() if pkgs & forbidden}
    assert bad == {}


def test_layout_exists() -> None:
    for p in ("extproc", "llmgw", "enginesim", "envoy", "protos", "policy", "tests", "docker-compose.yml",
              "README.md", "Makefile", ".ci/run", "pyproject.toml"):
        assert Path(ROOT / p).exists(), p


def test_each_command_module_registers_the_commands_the_cli_imports_it_for() -> None:
    """`llmgw X` imports only X's module (llmgw/cli.py COMMAND_MODULES): a command its module adds but
    the table does not name would be missing from the command line."""
    import argparse
    import importlib

    from llmgw.cli import BUILT_IN, COMMAND_MODULES, KNOWN_COMMANDS, build_parser

    for module, registrar, names in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        getattr(importlib.import_module(module), registrar)(sub)
        assert tuple(sub.choices) == names, module
    every = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(every) == KNOWN_COMMANDS
    for command in KNOWN_COMMANDS:  # each command's parser: the built-in ones and its module's
        own = next((set(names) for _, _, names in COMMAND_MODULES if command in names), set())
        assert set(build_parser(command)._subparsers._group_actions[0].choices) == (  # type: ignore[union-attr]
            set(BUILT_IN) | own)
