"""The package's layers (docs/architecture.md): each module imports only its own layer and
the layers below it, and no two modules import each other, even through others.

Read from the source (every import statement, including those inside functions), so a
lazy import cannot hide a wrong dependency.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "jupyter_scale"

# Bottom to top. A module not listed fails the test: a new module gets its layer here and
# in docs/architecture.md.
LAYERS = {
    "values": ["errors", "protocol", "records", "settings", "_version", "patches", "processes"],
    "worker": ["worker", "cellnames", "training", "sharding", "overlap", "batchnorm", "checkpoint", "rendezvous",
               "shipping", "receiving", "byvalue", "tensorbytes", "namespacepickle", "sendback", "explicit",
               "sampling", "torchrun", "resync", "interrupts", "collectives", "debugging",
               "statesync", "writewatch", "libraries", "notes", "sharedmem", "capture", "metrics", "frameworks",
               "frameworks.tensorflow", "frameworks.paddle", "frameworks.horovod", "script", "ray_job"],
    "engines": ["backends", "backends.base", "backends.ipyparallel", "backends.dask", "backends.ray",
                "backends.ray_cluster", "backends.ipyparallel_cluster", "backends.dask_cluster",
                "backends.channel", "backends.relay", "launchers", "forkserver", "programs", "programs.*"],
    "kernel": ["cluster", "group", "run", "debugger", "display", "pullback", "cellexport", "cellstart", "export", "jobfiles",
               "jobdir", "sinks", "frameworks.rules", "widgets", "widgets.dashboard", "notebooknames", "cellrequest",
               "cellend", "cellframes"],
    "session": ["session"],
    "front": ["", "magics", "sidebar"],
}
ORDER = list(LAYERS)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "labextension" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    for layer, names in LAYERS.items():
        for name in names:
            if module == name or (name.endswith(".*") and module.startswith(name[:-1])):
                return layer
    raise AssertionError(f"jupyter_scale.{module} has no layer: give it one in tests/test_layers.py and "
                         "docs/architecture.md")


def _imports(module: str) -> set[str]:
    """The package's modules that `module` imports (relative or absolute, anywhere in it)."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if module == "":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else list(package)
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "jupyter_scale" or node.module.startswith("jupyter_scale.")):
                target = node.module.removeprefix("jupyter_scale").lstrip(".")
            else:
                continue
            submodules = [f"{target}.{a.name}".lstrip(".") for a in node.names
                          if f"{target}.{a.name}".lstrip(".") in MODULES]
            found.update(submodules)
            if len(submodules) < len(node.names) and target in MODULES:
                found.add(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name.removeprefix("jupyter_scale").lstrip(".")
                if alias.name.startswith("jupyter_scale") and name in MODULES:
                    found.add(name)
    found.discard(module)
    return found


@pytest.mark.parametrize("module", sorted(MODULES), ids=lambda m: m or "jupyter_scale")
def test_a_module_imports_only_its_layer_and_those_below(module):
    mine = ORDER.index(_layer(module))
    above = sorted(f"{m} ({_layer(m)})" for m in _imports(module) if ORDER.index(_layer(m)) > mine)
    assert not above, f"jupyter_scale.{module or '__init__'} ({_layer(module)}) imports from layers above it: {above}"


def test_no_import_cycles():
    graph = {m: _imports(m) for m in MODULES if m}  # every module imports the package itself: not a cycle
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
