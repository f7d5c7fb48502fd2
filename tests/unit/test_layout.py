"""The layout is the architecture: the data plane (extproc/) imports neither the control plane
(llmgw/) nor the simulator (enginesim/), the simulator knows nothing of the gateway, no module
reaches itself through its imports, and no room (a folder's own modules) holds more than a third of
the house."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from extproc.names import EXTPROC_CLUSTER, SHADOW_CLUSTER, Filter
from tests.conftest import ROOT


def house_modules(package: str) -> list[Path]:
    """The package's Python files, not what npm installed beside its tests (tests/clients/node_modules)."""
    return [p for p in (ROOT / package).rglob("*.py") if "node_modules" not in p.parts]


def imported_packages(package: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in house_modules(package):
        tree = ast.parse(path.read_text(), str(path))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        out[str(path.relative_to(ROOT))] = {name.split(".")[0] for name in names}
    return out


PACKAGES = ("extproc", "llmgw", "enginesim", "tests")


def module_files() -> dict[str, Path]:
    """Every module of the house (and its tests) by dotted name; a package by its own name."""
    out = {}
    for package in PACKAGES:
        for path in house_modules(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Which modules each module imports, anywhere in it (inside functions and TYPE_CHECKING blocks
    too: a circle that is broken only at run time is still a circle to whoever reads the code).
    `from package import name` is an edge to the submodule when `name` is one, else to the package."""
    files = module_files()

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for a in node.names:
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base))
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py first: an edge to each package above
        # the target that does not also hold this module.
        for target in [t for t in targets if t]:
            parts = target.split(".")
            targets |= {p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                        if p in files and not module.startswith(p + ".")}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_anywhere() -> None:
    assert circles(import_graph()) == []


# What the renderer may read of the data plane: the wire names, the contract, the configuration and the
# shapes registry (and the package itself, for the Lua files' place). The rest of the data plane is
# request handling, which the bootstrap must not depend on.
RENDER_READS = {"extproc", "extproc.names", "extproc.contract", "extproc.config", "extproc.shapes",
                "extproc.shapes.registry"}


def test_the_renderer_reads_only_names_contract_config_and_shapes() -> None:
    graph = import_graph()
    reads = {m: sorted(t for t in targets if t.startswith("extproc") and t not in RENDER_READS
                       and not t.startswith("extproc.config."))
             for m, targets in graph.items() if m.startswith("llmgw.render")}
    assert {m: t for m, t in reads.items() if t} == {}


def test_the_command_line_is_a_room_nothing_else_imports() -> None:
    """`llmgw/cli/` holds the commands, thin, each with `register(sub)`; what they run lives in the
    other rooms (ops, local, bench, chaos, conformance, render), which never reach back into it."""
    from llmgw.cli import BENCH_MODULES, COMMAND_MODULES

    graph = import_graph()
    reaching_back = {m: sorted(t for t in targets if t == "llmgw.cli" or t.startswith("llmgw.cli."))
                     for m, targets in graph.items()
                     if m.startswith("llmgw.") and not m.startswith("llmgw.cli") and m != "llmgw.__main__"}
    assert {m: t for m, t in reaching_back.items() if t} == {}
    assert [m for m, _ in COMMAND_MODULES if not m.startswith("llmgw.cli.")] == []
    assert [m for m in BENCH_MODULES if not m.startswith("llmgw.bench.")] == []


WIRE_NAME_HOMES = {"extproc/names.py", "extproc/contract.py"}
OWN_NAMES = {*Filter, EXTPROC_CLUSTER, SHADOW_CLUSTER}


def spelled_wire_names(path: Path) -> list[str]:
    """String literals in code (not docstrings) that spell a header or filter name of the gateway's."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [f"{path.relative_to(ROOT)}:{n.lineno}: {n.value}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and ("x-llmgw-" in n.value or n.value in OWN_NAMES)]


def test_wire_names_are_spelled_once() -> None:
    """Every header, filter and cluster name of the gateway's is in extproc/names.py or contract.py;
    the data plane and the control plane name them from there (tests, the clients' view, may spell them)."""
    spelled = [hit for package in ("extproc", "llmgw") for path in sorted((ROOT / package).rglob("*.py"))
               if str(path.relative_to(ROOT)) not in WIRE_NAME_HOMES for hit in spelled_wire_names(path)]
    assert spelled == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": {"e"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["e", "e2"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_room_holds_more_than_a_third_of_the_house() -> None:
    """A room is a folder's own modules (Python and the Lua Envoy runs); the house is all of them."""
    rooms: dict[str, int] = {}
    for package in ("extproc", "llmgw", "enginesim"):
        for path in (ROOT / package).rglob("*"):
            if path.suffix in (".py", ".lua"):
                room = str(path.parent.relative_to(ROOT))
                rooms[room] = rooms.get(room, 0) + len(path.read_text().splitlines())
    house = sum(rooms.values())
    assert {room: lines for room, lines in rooms.items() if lines > house / 3} == {}


@pytest.mark.parametrize(("package", "forbidden"), [
    ("extproc", {"llmgw", "enginesim"}),
    ("enginesim", {"llmgw", "extproc"}),
    # The shapes translate plain values: no Envoy, gRPC or protobuf types.
    ("extproc/shapes", {"llmgw", "enginesim", "envoy", "grpc", "google", "xds", "udpa"}),
])
def test_no_forbidden_imports(package: str, forbidden: set[str]) -> None:
    bad = {f: sorted(pkgs & forbidden) for f, pkgs in imported_packages(package).items() if pkgs & forbidden}
    assert bad == {}


def test_layout_exists() -> None:
    for p in ("extproc", "llmgw", "enginesim", "envoy", "protos", "policy", "tests", "docker-compose.yml",
              "README.md", "Makefile", ".ci/run", "pyproject.toml"):
        assert Path(ROOT / p).exists(), p


def test_each_command_module_registers_the_commands_the_cli_imports_it_for() -> None:
    """`llmgw X` imports only X's module (llmgw/cli/__init__.py COMMAND_MODULES): a command its module adds but
    the table does not name would be missing from the command line."""
    import argparse
    import importlib

    from llmgw.cli import BUILT_IN, COMMAND_MODULES, KNOWN_COMMANDS, build_parser

    for module, names in COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        assert tuple(sub.choices) == names, module
    every = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(every) == KNOWN_COMMANDS
    for command in KNOWN_COMMANDS:  # each command's parser: the built-in ones and its module's
        own = next((set(names) for _, names in COMMAND_MODULES if command in names), set())
        assert set(build_parser(command)._subparsers._group_actions[0].choices) == (  # type: ignore[union-attr]
            set(BUILT_IN) | own)


# The settlement room (extproc/settlement/): the charge is a pure function of what was seen, and only the
# room writes settlements to the store.
CHARGE_READS = {"__future__", "math", "dataclasses", "typing", "extproc.config", "extproc.config.plans",
                "extproc.config.schema", "extproc.contract", "extproc.shapes.base"}


def test_the_charge_rule_is_pure() -> None:
    """extproc/settlement/charge.py decides from values alone: no store, no Envoy or gRPC types, no clock,
    no event loop - so its tables (tests/unit/test_accounting.py) are the whole of it."""
    path = ROOT / "extproc/settlement/charge.py"
    tree = ast.parse(path.read_text(), str(path))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - CHARGE_READS == set()


def settlement_writers(paths: list[Path] | None = None, root: Path = ROOT) -> dict[str, list[str]]:
    """Modules outside the settlement room and the store that make a Settlement or call the store's
    settle: one entry point into the store."""
    out: dict[str, list[str]] = {}
    for path in paths if paths is not None else house_modules("extproc") + house_modules("llmgw"):
        rel = str(path.relative_to(root))
        if rel.startswith(("extproc/settlement/", "extproc/store/")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id == "Settlement":
                out.setdefault(rel, []).append("Settlement(...)")
            elif isinstance(f, ast.Attribute) and f.attr in ("settle", "settle_many"):
                owner = f.value.attr if isinstance(f.value, ast.Attribute) else getattr(f.value, "id", "")
                if "store" in owner:  # a store's settle, not another object's of the same name
                    out.setdefault(rel, []).append(f"{owner}.{f.attr}(...)")
    return out


def test_only_the_settlement_room_writes_settlements() -> None:
    assert settlement_writers() == {}


def test_the_writer_finder_finds_a_writer(tmp_path: Path) -> None:
    """The rule above can fail: a module that settles through the store itself is found; a stage that
    settles through the room, or another object's `settle`, is not."""
    (tmp_path / "extproc/stages").mkdir(parents=True)
    stray, fine = tmp_path / "extproc/stages/stray.py", tmp_path / "extproc/stages/fine.py"
    stray.write_text("async def f(self, s):\n    await self.store.settle(s)\n")
    fine.write_text("async def f(loops, meter):\n    loops.settle()\n    await meter.settle(1)\n")
    assert settlement_writers([stray, fine], tmp_path) == {"extproc/stages/stray.py": ["store.settle(...)"]}


def test_starting_ext_proc_is_a_room_of_its_own() -> None:
    """extproc/server.py starts the service (the command line, secrets, the servers, the loops):
    nothing in the data plane imports it but `python -m extproc`; the service it starts
    (extproc/service/) never reaches back into it."""
    graph = import_graph()
    importers = sorted(m for m, targets in graph.items() if "extproc.server" in targets and m.startswith("extproc"))
    assert importers == ["extproc.__main__"]
