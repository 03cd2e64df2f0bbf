"""Import rules between the packages of `swarm`, checked on the source with `ast`.

* `swarm.core` is pure decision logic: standard library and `swarm.core` only, and no clock,
  event loop, sockets or global random state.
* Only the packages in `HIVEMIND_ALLOWED` touch hivemind, so the rest of the runtime stays testable
  without it and a change of transport is confined to them.
* Nothing imports `swarm.cli`: it is the outermost layer.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
HIVEMIND_ALLOWED = ("swarm.net", "swarm.averaging")
CORE = "swarm.core"
CLI = "swarm.cli"
# Standard-library modules that would give core decisions a hidden clock, event loop or I/O.
CORE_FORBIDDEN_STDLIB = (
    "asyncio",
    "multiprocessing",
    "selectors",
    "socket",
    "subprocess",
    "threading",
    "time",
)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _within_any(name: str, packages: tuple[str, ...]) -> bool:
    return any(_within(name, p) for p in packages)


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import; `from m import x` yields `m.x`, relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def global_random_uses(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Uses of the `random` module's hidden global generator (anything but constructing `Random`)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "random"}
        elif isinstance(node, ast.ImportFrom) and node.module == "random" and not node.level:
            for alias in node.names:
                if alias.name != "Random":
                    yield node.lineno, f"from random import {alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr != "Random"
        ):
            yield node.lineno, f"{node.value.id}.{node.attr}"


def core_violations(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    if not _within(module, CORE):
        return
    for line, name in imports(tree, module, is_package):
        top = name.split(".")[0]
        if _within(name, CORE):
            continue
        if top not in sys.stdlib_module_names:
            yield line, f"imports {name} (core may import only the standard library and {CORE})"
        elif top in CORE_FORBIDDEN_STDLIB:
            yield line, f"imports {name} (core gets time and I/O passed in, never from {top})"
    for line, use in global_random_uses(tree):
        yield line, f"uses the global random generator via {use} (pass a random.Random in)"


def hivemind_violations(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    if _within_any(module, HIVEMIND_ALLOWED):
        return
    for line, name in imports(tree, module, is_package):
        if _within(name, "hivemind"):
            yield line, f"imports {name} (only {', '.join(HIVEMIND_ALLOWED)} may import hivemind)"


def cli_violations(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    if _within(module, CLI):
        return
    for line, name in imports(tree, module, is_package):
        if _within(name, CLI):
            yield line, f"imports {name} ({CLI} is the outermost layer; nothing may import it)"


def _modules() -> list[tuple[Path, str, ast.AST]]:
    found = []
    for path in sorted((SRC / "swarm").rglob("*.py")):
        found.append((path, module_name(path), ast.parse(path.read_text(), filename=str(path))))
    return found


def _report(check) -> list[str]:
    problems = []
    for path, module, tree in _modules():
        is_package = path.name == "__init__.py"
        for line, message in check(tree, module, is_package):
            problems.append(f"{path.relative_to(SRC.parent)}:{line}: {message}")
    return problems


def test_sources_found():
    modules = {module for _, module, _ in _modules()}
    assert {"swarm", CORE, "swarm.core.routing"} <= modules


def test_core_is_pure():
    problems = _report(core_violations)
    assert not problems, "swarm.core must stay pure:\n" + "\n".join(problems)


def test_hivemind_only_in_allowed_packages():
    problems = _report(hivemind_violations)
    assert not problems, "hivemind imported outside its packages:\n" + "\n".join(problems)


def test_nothing_imports_cli():
    problems = _report(cli_violations)
    assert not problems, "swarm.cli imported from elsewhere:\n" + "\n".join(problems)


def _check_snippet(check, source: str, module: str, is_package: bool = False) -> list[int]:
    return sorted(line for line, _ in check(ast.parse(source), module, is_package))


def test_checks_catch_violations():
    core_src = (
        "import random\nimport torch\nimport time\nfrom asyncio import sleep\n"
        "from swarm.net import x\nrandom.random()\nfrom random import choice\n"
        "import json\nfrom . import bans\nrng = random.Random(0)\n"
    )
    assert _check_snippet(core_violations, core_src, "swarm.core.routing") == [2, 3, 4, 5, 6, 7]
    assert _check_snippet(core_violations, core_src, "swarm.server.stage") == []
    hivemind_src = "import hivemind\nfrom hivemind.p2p import P2P\n"
    assert _check_snippet(hivemind_violations, hivemind_src, "swarm.server") == [1, 2]
    assert _check_snippet(hivemind_violations, "import hivemind\n", "swarm.net.dht") == []
    assert _check_snippet(cli_violations, "from swarm import cli\n", "swarm.trainer") == [1]
    assert _check_snippet(cli_violations, "from ..cli.main import main\n", "swarm.trainer.loop") == [1]
    assert _check_snippet(cli_violations, "from .commands import run\n", "swarm.cli.main") == []


def test_relative_imports_resolve():
    tree = ast.parse("from . import a\nfrom .b import c\nfrom .. import d\n")
    assert [n for _, n in imports(tree, "swarm.core", is_package=True)] == [
        "swarm.core.a",
        "swarm.core.b.c",
        "swarm.d",
    ]
    assert [n for _, n in imports(tree, "swarm.core.routing", is_package=False)] == [
        "swarm.core.a",
        "swarm.core.b.c",
        "swarm.d",
    ]


MAX_MODULE_LINES = 400  # a module a reader can hold in their head: one role each


def test_no_module_is_a_room_to_get_lost_in():
    long = [f"{path.relative_to(SRC.parent)}: {n} lines" for path, _, _ in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_the_step_decision_is_pure_and_the_server_only_carries_it_out():
    """When and with whom a stage steps is `swarm.core.stepping.plan_step`; the server's step loop
    calls it and decides nothing of its own."""
    modules = {module: tree for _, module, tree in _modules()}
    defined = {node.name for node in ast.walk(modules["swarm.core.stepping"]) if isinstance(node, ast.FunctionDef)}
    assert {"plan_step", "accept_proposal"} <= defined
    called = {node.func.id for node in ast.walk(modules["swarm.server.stepping"])
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "plan_step" in called
    assert "stage_ready" not in called and "expected_group" not in called
