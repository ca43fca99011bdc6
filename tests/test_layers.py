"""The dependency rules of docs/architecture.md ("Layers"), checked on the source itself.

Every import of a first-party package, at the top of a module or inside a function, counts.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contract", "model", "export", "server", "client", "loadtest", "bench")
FIRST_PARTY = (*PACKAGES, "embedding")  # embedding: the generated gRPC stubs

# What each package may import, besides itself and third-party code.
MAY_IMPORT = {
    "contract": set(),
    "model": {"contract"},
    "export": {"contract", "model"},
    "server": {"contract", "embedding"},
    "client": {"embedding"},
    "loadtest": {"contract", "server", "client", "model", "embedding"},
    "bench": {"contract", "server", "client", "model", "export", "loadtest", "embedding"},
}

# Inside server/: what each layer may import of server/ besides itself. The process level (server/*.py: app
# assembly, config, workers, loops, metrics, auth, model loading) may import every layer. The front ends count
# requests in the process's metrics, the one process-level module they may import.
SERVER_LAYERS = {
    "core": {"core"},
    "backend": {"backend", "core"},
    "api": {"api", "core", "backend", "metrics"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> set[str]:
    """First-party modules the file imports (``from server import memory`` counts as server.memory)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in FIRST_PARTY}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in FIRST_PARTY:
                continue
            # from package import submodule counts as the submodule
            submodules = {f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}")}
            found |= submodules or {node.module}
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    return {module_name(path): imports(path) for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def test_packages_import_only_the_packages_below_them() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        for target in targets
        if (top := target.split(".")[0]) != module.split(".")[0] and top not in MAY_IMPORT[module.split(".")[0]]
    ]
    assert wrong == []


def server_layer(module: str) -> str:
    """core, backend or api for a module in those packages; the module's own name at the process level."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def test_server_layers_import_only_what_their_rules_allow() -> None:
    modules = [m for m in graph() if m.startswith("server.") and server_layer(m) in SERVER_LAYERS]
    assert {server_layer(m) for m in modules} == set(SERVER_LAYERS), "every layer has modules"
    wrong = [
        f"{module} imports {target}"
        for module in modules
        for target in graph()[module]
        if target.startswith("server.") and server_layer(target) not in SERVER_LAYERS[server_layer(module)]
    ]
    assert wrong == []


def test_server_top_level_holds_the_layers_and_the_process_level_only() -> None:
    top = sorted(p.name for p in (ROOT / "server").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    assert top == [
        "__init__.py",
        "__main__.py",
        "api",
        "app.py",
        "auth.py",
        "backend",
        "config.py",
        "core",
        "loading.py",
        "loops.py",
        "memory.py",
        "metrics.py",
        "workers.py",
    ]


def test_no_import_cycles() -> None:
    edges = graph()
    cycles, state = [], dict.fromkeys(edges, 0)  # 0 new, 1 on the path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if target not in edges:
                continue  # a generated stub
            if state[target] == 1:
                cycles.append([*path[path.index(target) :], target])
            elif state[target] == 0:
                visit(target, [*path, target])
        state[module] = 2

    for module in edges:
        if state[module] == 0:
            visit(module, [module])
    assert cycles == []


def test_torch_is_imported_only_by_training_export_and_benchmarks() -> None:
    users: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(n == "torch" or n.startswith("torch.") for n in names):
                    users[package].add(module_name(path))
    assert set(users) <= {"model", "export", "bench"}, dict(users)
