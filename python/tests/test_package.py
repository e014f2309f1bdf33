"""The package's shape: its modules import only modules below them (no import cycles, the order
``kvstage/__init__.py`` documents), and ``import kvstage`` exports the 0.4 API (the 0.3 names are
gone). Needs no library."""

import ast
import os

import kvstage

PACKAGE = os.path.dirname(os.path.abspath(kvstage.__file__))

#: Bottom to top: a module may import only modules listed before it (``__init__`` imports them all).
ORDER = [
    "_version",
    "_lib",
    "errors",
    "_common",
    "_buffers",
    "_tensors",
    "_logging",
    "library",
    "stats",
    "pool",
    "parts",
    "room",
    "geometry",
    "op",
    "session",
    "completion",
    "engine",
    "shared",
    "diagnostics",
    "staging",
    "prometheus",
]


def _imports(module: str) -> set:
    """The package modules ``module`` imports, at its top or inside functions."""
    with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import y
                found.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import x, y
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.split(".")[0] == "kvstage":
                rest = node.module.split(".")[1:]
                found.update(rest[:1] if rest else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "kvstage":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def test_modules_import_only_modules_below_them():
    modules = sorted(f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py")
    assert sorted(ORDER) == modules, "list every module of kvstage/ in ORDER (bottom to top)"
    problems = []
    for module in ORDER:
        for dep in sorted(_imports(module)):
            if dep not in ORDER:
                problems.append(f"{module} imports {dep}, which is not a module of the package (the package's __init__?)")
            elif ORDER.index(dep) >= ORDER.index(module):
                problems.append(f"{module} imports {dep}, which is not below it")
    assert not problems, "\n".join(problems)


def test_the_import_graph_is_acyclic_and_reads_as_documented():
    graph = {module: _imports(module) for module in ORDER}
    done, active = set(), []

    def visit(module):
        assert module not in active, f"import cycle: {' -> '.join(active[active.index(module):] + [module])}"
        if module in done:
            return
        active.append(module)
        for dep in graph[module]:
            visit(dep)
        active.pop()
        done.add(module)

    for module in ORDER:
        visit(module)
    # The layers the brief of the split asked for, spot-checked: no object module reaches up.
    assert graph["_lib"] == {"_version"}
    assert graph["errors"] == {"_lib"}
    assert "engine" not in graph["room"] | graph["session"] | graph["op"]
    assert "session" not in graph["op"] and "library" not in graph["_logging"]


def test_the_0_4_api_is_exported():
    missing = [name for name in kvstage.__all__ if not hasattr(kvstage, name)]
    assert not missing, missing
    assert kvstage.TIMEOUT_INFINITE == (1 << 64) - 1
    assert [int(k) for k in kvstage.CompletionKind] == [1, 2, 3] and [int(k) for k in kvstage.RoomEventKind] == [1, 2]
    # Renamed or removed in 0.4 (see the C API's migration): no stale alias stays behind.
    for gone in ("DEADLINE_INFINITE", "transfer_timings_last", "writers_per_chunk", "ChunkEvent", "RoomOpening"):
        assert not hasattr(kvstage, gone), gone
    for gone in ("room_open", "room_wait", "room_release", "room_describe", "room", "transport_describe"):
        assert not hasattr(kvstage.Engine, gone), gone
    for method in ("wait", "release", "describe", "poll_events"):
        assert callable(getattr(kvstage.Room, method)), method
    assert "timeout_ms" in kvstage.TransferTarget.__dataclass_fields__ and "deadline_ms" not in kvstage.TransferTarget.__dataclass_fields__
