"""The dependency rules of docs/architecture.md ("Dependency direction"), checked on the source itself.

Every import of a first-party package, at the top of a module or inside a function, counts.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contract", "model", "export", "server", "loadtest", "bench")
FIRST_PARTY = (*PACKAGES, "embedding")  # embedding: the generated gRPC stubs

# What each package may import, besides itself and third-party code.
MAY_IMPORT = {
    "contract": set(),
    "model": {"contract"},
    "export": {"contract", "model"},
    "server": {"contract", "embedding"},
    "loadtest": {"contract", "server", "model", "embedding"},
    "bench": {"contract", "server", "model", "export", "loadtest", "embedding"},
}

# Inside server/, lowest first: a module imports only modules of lower layers.
SERVER_LAYERS = (
    {"request_ids", "batch_forming"},
    {"errors", "loops", "memory", "runtime", "client"},
    {"config", "admission", "auth", "backend", "batcher", "tokenize"},
    {"metrics", "workers"},
    {"pipeline"},
    {"models"},
    {"http_fields"},
    {"service", "http"},
    {"open_inference", "http_connection"},
    {"app"},
    {"__main__"},
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """First-party modules the file imports (``from server import memory`` counts as server.memory)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in FIRST_PARTY}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in FIRST_PARTY:
                continue
            if node.module in PACKAGES:  # from package import submodule
                found |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                found.add(node.module)
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


def test_server_modules_import_only_lower_layers() -> None:
    layer = {name: i for i, names in enumerate(SERVER_LAYERS) for name in names}
    modules = {m.removeprefix("server.") for m in graph() if m.startswith("server.")}
    assert modules == set(layer), "every server module has a layer"
    wrong = [
        f"server.{module} (layer {layer[module]}) imports {target} (layer {layer[target.split('.')[1]]})"
        for module in modules
        for target in graph()[f"server.{module}"]
        if target.startswith("server.") and layer[target.split(".")[1]] >= layer[module]
    ]
    assert wrong == []


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
