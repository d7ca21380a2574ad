"""`%scale export`: a %%distribute cell and the notebook code it needs, as a script.

The script (`train.py`) is the notebook sliced for one cell:

- the names the cell reads (the same free-name analysis as shipping) are followed through
  the notebook: a module or an object imported from one becomes an import; a function or
  class defined in the notebook becomes the statement of the executed cell that last
  defined it (and later statements that set its attributes), whose own reads are followed
  in turn; a literal (a number, a string) is written as one; any other value (tensors,
  datasets, models with their current weights) is saved beside the script, once, and
  loaded by it (after the cell ran, as it started when a copy was kept: see cellstart).
  The notebook classes those saved values are made of are followed too, since loading
  them needs their definitions.
- with `save_values=False` the values are made by the notebook code that made them
  instead (the statements that last bound them, the ones that changed them afterwards and
  the seeding calls before them): the script loads its own data.
- statements come in execution order; magics, shell escapes and statements that define
  nothing the cell needs are left out.

An export is honest: a name whose definition cannot be found, or made with IPython
syntax, or whose value cannot be saved, fails the export by name, before anything is
written.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.metadata
import io
import pickle
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .cellnames import free_names
from .errors import DistributeError

SEEDING_CALLS = {"manual_seed", "seed", "set_seed", "seed_everything", "manual_seed_all"}


class ExportError(DistributeError):
    """The cell cannot become a script that runs: the message names what is missing."""


# --------------------------------------------------------------------------------------
# The notebook's executed cells, as statements
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Statement:
    """One top-level statement of an executed cell."""

    cell: int | None  # In [n], when the notebook numbers it
    index: int  # its place among all statements, in execution order
    cell_index: int  # its cell's place among the cells run
    source: str
    binds: frozenset[str]  # names it binds in the notebook's namespace
    changes: frozenset[str]  # names whose object it changes (Net.forward = f, model.load_state_dict(...))
    reads: tuple[str, ...]
    ipython: bool  # made from IPython syntax (%magic, !shell): a script cannot run it
    seeds: bool  # torch.manual_seed(0) and the like

    def first_line(self) -> str:
        return self.source.strip().splitlines()[0][:80]


def notebook_statements(cells: Iterable[tuple[int | None, str]], transform: Callable[[str], str]) -> list[Statement]:
    """The top-level statements of `cells` ((In [n] or None, raw source), in execution order);
    `transform` turns IPython syntax into Python (the shell's transform_cell)."""
    statements: list[Statement] = []
    for cell_index, (number, raw) in enumerate(cells):
        code = transform(raw)
        try:
            tree = ast.parse(code)
        except SyntaxError:  # a cell that failed to compile defined nothing
            continue
        lines = code.splitlines(keepends=True)
        for node in tree.body:
            decorators = getattr(node, "decorator_list", [])
            if decorators:  # whole lines, from the first decorator
                source = "".join(lines[decorators[0].lineno - 1:node.end_lineno])
            else:
                source = ast.get_source_segment(code, node) or ""
            try:
                reads = tuple(free_names(source))
            except SyntaxError:  # a segment that only parses in its cell
                reads = ()
            statements.append(Statement(
                cell=number, index=len(statements), cell_index=cell_index, source=source.rstrip() + "\n",
                binds=frozenset(_bound_names(node)), changes=frozenset(_changed_names(node)), reads=reads,
                ipython=any(isinstance(n, ast.Name) and n.id == "get_ipython" for n in ast.walk(node)),
                seeds=_is_seeding(node)))
    return statements


def check_script_syntax(body: str, transform: Callable[[str], str]) -> None:
    """A script runs plain Python: a cell that needs IPython's syntax is refused, by line."""
    try:
        ast.parse(body)
        return
    except SyntaxError as exc:
        ast.parse(transform(body))  # not Python even for IPython: the SyntaxError says where
        line = body.splitlines()[(exc.lineno or 1) - 1].strip() if body.splitlines() else ""
        raise ExportError(f"cannot export: line {exc.lineno} of the cell is IPython syntax ({line[:60]}), "
                          "which a script cannot run") from None


_NEW_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
               ast.DictComp, ast.GeneratorExp)


def _bound_names(node: ast.AST) -> set[str]:
    """Names a top-level statement binds at module level (not inside the functions,
    classes and comprehensions it defines)."""
    names: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Import):
        return {alias.asname or alias.name.split(".")[0] for alias in node.names}
    if isinstance(node, ast.ImportFrom):
        return {alias.asname or alias.name for alias in node.names if alias.name != "*"}
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return {node.id}
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _NEW_SCOPES):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(child.name)
            continue
        names |= _bound_names(child)
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _changed_names(node: ast.AST) -> set[str]:
    """`X.a = ...`, `X[k] = ...`, `X.method(...)`, `setattr(X, ...)`: X changes."""
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        call = node.value
        if isinstance(call.func, ast.Attribute):
            targets = [call.func.value]
        elif isinstance(call.func, ast.Name) and call.func.id == "setattr" and call.args:
            targets = [call.args[0]]
    roots = {_root_name(t) for t in targets if not isinstance(t, ast.Name)}
    return {r for r in roots if r}


def _is_seeding(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    func = node.value.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in SEEDING_CALLS


# --------------------------------------------------------------------------------------
# What the script needs
# --------------------------------------------------------------------------------------


@dataclass
class ScriptPlan:
    body: str
    imports: dict[str, str] = field(default_factory=dict)  # name -> its import statement (generated)
    import_statements: dict[int, Statement] = field(default_factory=dict)  # the notebook's own
    literals: dict[str, str] = field(default_factory=dict)  # name -> its repr
    statements: list[Statement] = field(default_factory=list)  # in execution order
    after_load: list[Statement] = field(default_factory=list)  # definitions that read saved values
    reads_injected: bool = False  # the notebook's statements read rank, device, ...
    values: dict[str, Any] = field(default_factory=dict)  # saved beside the script
    models: list[str] = field(default_factory=list)  # the notebook's nn.Modules the cell trains
    modules: set[str] = field(default_factory=set)  # top-level modules the script imports


def _importable_as(value: Any) -> tuple[str, str] | None:
    """(module, qualified name) where `value` can be imported from, if it can."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__" or "<" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # not where it says it lives (a class made on the fly)
        return None
    return (module, qualname) if found is value else None


def _is_notebook_code(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__"


_LITERAL_TYPES = (bool, int, float, complex, str, bytes, type(None))


def _literal(value: Any) -> str | None:
    """The value's repr when it is a short literal that reads back equal."""
    def plain(v: Any) -> bool:
        if isinstance(v, (list, tuple, set)):
            return type(v) in (list, tuple, set) and all(map(plain, v))
        if isinstance(v, dict):
            return type(v) is dict and all(plain(k) and plain(x) for k, x in v.items())
        return type(v) in _LITERAL_TYPES
    if not plain(value):
        return None
    text = repr(value)
    try:
        same = len(text) <= 400 and ast.literal_eval(text) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return text if same else None


def _import_statement(name: str, value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__}" if name == value.__name__ else f"import {value.__name__} as {name}"
    module, qualname = _importable_as(value)  # type: ignore[misc]
    if "." in qualname:  # a nested class or a method
        return f"import {module}\n{name} = {module}.{qualname}"
    return f"from {module} import {qualname}" + (f" as {name}" if name != qualname else "")


def plan_script(body: str, namespace: dict, statements: list[Statement], *, save_values: bool = True,
                eligible: Callable[[str], bool] = lambda name: True, workers_own: Iterable[str] = (),
                injected: Iterable[str] = ()) -> ScriptPlan:
    """Follow the names `body` reads through the notebook (see the module's docstring).
    Raises ExportError naming the first name that cannot be exported.

    A notebook function or class is its last definition (what the notebook runs now), whose
    reads are the notebook's values now too. Without saved values, a value is what the
    statements that made it made: the last statement to bind it before the statement that
    reads it (`x = (x - x.mean()) / x.std()` reads the x made before it), and the
    statements that changed it in between."""
    plan = ScriptPlan(body=body)
    binders: dict[str, list[Statement]] = {}
    for statement in statements:
        for name in statement.binds:
            binders.setdefault(name, []).append(statement)
    # A name only the workers hold, that the cell reads and never binds, cannot come along.
    bound_in_body = _bound_names(ast.parse(body)) | {
        n.id for n in ast.walk(ast.parse(body)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    workers_own = set(workers_own) - bound_in_body
    chosen: dict[int, Statement] = {}
    done: set[tuple[str, int]] = set()
    end = len(statements)  # reads of the cell (or of code run later): every statement before them

    def take(statement: Statement, name: str, what: str, reads_now: bool = False) -> None:
        if statement.ipython:
            raise ExportError(f"cannot export: {name} ({what}) is made with IPython syntax in "
                              f"{_cell_name(statement.cell)} ({statement.first_line()}), which a script cannot run")
        chosen[statement.index] = statement
        pending.extend((read, end if reads_now else statement.index) for read in statement.reads)

    def definition(name: str, what: str, before: int, reads_now: bool = False) -> None:
        found = [s for s in binders.get(name, []) if s.index < before]
        if not found:
            raise ExportError(f"cannot export: {name} ({what}) is not defined by any executed cell of this notebook "
                              "(made by %run, exec, an extension, or inside a cell magic such as %%time?); "
                              "define it in a cell of its own, or import it from a module")
        last = found[-1]
        take(last, name, what, reads_now)
        for later in statements[last.index + 1:before]:  # what changed it since (Net.forward = forward)
            if name in later.changes and not later.ipython:
                take(later, name, what, reads_now)

    pending: list[tuple[str, int]] = [(name, end) for name in free_names(body)]
    while True:
        while pending:
            name, before = pending.pop(0)
            if name not in namespace or not eligible(name):
                if name in workers_own and before == end and not hasattr(builtins, name):
                    raise ExportError(f"cannot export: {name} exists only on the workers (bound by an earlier "
                                      "%%distribute cell); export that code with this cell, or define it in the notebook")
                if name in injected and before < end:
                    plan.reads_injected = True
                continue
            if not save_values and before == end and name in bound_in_body and not binders.get(name):
                continue  # the cell binds it (its value here came back from an earlier %%distribute run of it)
            value = namespace[name]
            code = _is_notebook_code(value)
            imported = isinstance(value, types.ModuleType) or _importable_as(value) is not None
            if not (save_values or code or imported) and binders.get(name):
                # Made by the notebook's statements, as it was when read.
                if (name, before) in done:
                    continue
                done.add((name, before))
                definition(name, type(value).__name__, before)
                if before == end and isinstance(value, torch.nn.Module):
                    plan.models.append(name)
                continue
            if (name, end) in done:
                continue
            done.add((name, end))
            if isinstance(value, torch.nn.Module):
                plan.models.append(name)
            if imported:
                last = binders.get(name, [None])[-1]
                if last is not None and isinstance(ast.parse(last.source).body[0], (ast.Import, ast.ImportFrom)):
                    plan.import_statements[last.index] = last  # the notebook's own import line
                else:
                    plan.imports[name] = _import_statement(name, value)
                top = value.__name__ if isinstance(value, types.ModuleType) else value.__module__
                plan.modules.add(top.split(".")[0])
            elif code:  # what the notebook runs now, reading the notebook's values when it runs: now
                definition(name, f"a {'class' if isinstance(value, type) else 'function'} of the notebook", end,
                           reads_now=True)
            elif (text := _literal(value)) is not None:
                plan.literals[name] = text
            elif save_values:
                plan.values[name] = value
            else:
                definition(name, type(value).__name__, end)
        # The notebook classes and functions the saved values are made of: loading needs them.
        refs, modules = pickled_references(plan.values)
        plan.modules |= modules
        pending = [(name, end) for name in sorted(refs) if (name, end) not in done]
        if not save_values:  # the seeding calls before the code that makes the values
            latest = max(chosen, default=-1)
            for seeding in statements[:latest]:
                if seeding.seeds and not seeding.ipython and seeding.index not in chosen:
                    take(seeding, "a seed", "seeding")
        if not pending:
            break
    # Imports first, whichever cell ran them last: a class whose base a later cell imported again.
    for index in [i for i, s in chosen.items() if _is_import(s)]:
        plan.import_statements[index] = chosen.pop(index)
    for index in sorted(chosen):
        statement = chosen[index]
        # A definition that reads a saved value as it runs (a default argument, a class body)
        # comes after the values are loaded, unless loading them needs it.
        if set(_definition_reads(statement.source)) & plan.values.keys():
            if statement.binds & refs:
                raise ExportError(f"cannot export: {sorted(statement.binds & refs)[0]} reads the saved value(s) "
                                  f"{sorted(set(_definition_reads(statement.source)) & plan.values.keys())} as it is "
                                  "defined, and those values need it to load; define it without them")
            plan.after_load.append(statement)
        else:
            plan.statements.append(statement)
    for statement in [*plan.import_statements.values(), *plan.statements, *plan.after_load]:
        if set(statement.reads) & set(injected):
            plan.reads_injected = True
        for node in ast.walk(ast.parse(statement.source)):
            if isinstance(node, ast.Import):
                plan.modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                plan.modules.add(node.module.split(".")[0])
    plan.import_statements = dict(sorted(plan.import_statements.items()))
    return plan


def _is_import(statement: Statement) -> bool:
    return isinstance(ast.parse(statement.source).body[0], (ast.Import, ast.ImportFrom))


def _definition_reads(source: str) -> list[str]:
    """The names a statement reads as it runs: not those inside the functions it defines
    (their bodies run later), but their defaults, decorators and annotations, and a class
    body's."""
    reads = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            for default in [*arguments.defaults, *(d for d in arguments.kw_defaults if d is not None)]:
                visit(default)
            for decorator in getattr(node, "decorator_list", []):
                visit(decorator)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads.append(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return reads


# --------------------------------------------------------------------------------------
# Saved values
# --------------------------------------------------------------------------------------


class _RecordingPickler(pickle.Pickler):
    """Records what loading the pickle will import: notebook classes and functions
    (`__main__`, which the script defines) and the modules of all others."""

    main: set[str]
    modules: set[str]

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            module = getattr(obj, "__module__", None)
            if module == "__main__":
                self.main.add(obj.__qualname__.split(".")[0])
            elif isinstance(module, str):
                self.modules.add(module.split(".")[0])
        return NotImplemented


def _recording_module() -> types.SimpleNamespace:
    main: set[str] = set()
    modules: set[str] = set()

    class Pickler(_RecordingPickler):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.main, self.modules = main, modules

    return types.SimpleNamespace(Pickler=Pickler, main=main, modules=modules, __name__="pickle")


def pickled_references(values: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(notebook names, top-level modules) that loading `values` needs. Names the first
    value that cannot be saved."""
    if not values:
        return set(), set()
    recording = _recording_module()
    try:
        torch.save(values, io.BytesIO(), pickle_module=recording)
    except Exception:
        for name, value in values.items():  # which one
            try:
                torch.save(value, io.BytesIO(), pickle_module=_recording_module())
            except Exception as exc:  # pickling raises many types
                raise ExportError(f"cannot export: {name} ({type(value).__name__}) cannot be saved: "
                                  f"{type(exc).__name__}: {exc}. Make it in the cell or in code the cell "
                                  "calls, or export without values") from None
        raise
    return set(recording.main), set(recording.modules)


def save_values(values: dict[str, Any], file: Path | BinaryIO) -> dict[str, int]:
    """Write `values` (one pickle: objects two names share stay shared) to a path or an
    open binary file; returns each name's size in bytes, roughly (its tensors and the rest
    of its pickle)."""
    torch.save(values, file)
    sizes = {}
    for name, value in values.items():
        counter = _ByteCounter()
        torch.save(value, counter)  # type: ignore[arg-type]
        sizes[name] = counter.size
    return sizes


class _ByteCounter(io.RawIOBase):
    def __init__(self) -> None:
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        n = memoryview(data).nbytes
        self.size += n
        return n


# --------------------------------------------------------------------------------------
# Requirements and local modules
# --------------------------------------------------------------------------------------


def requirements(modules: Iterable[str], local: Iterable[str] = (), extras: dict[str, str] | None = None) -> list[str]:
    """`dist==version` lines for the installed distributions that provide `modules`
    (the standard library and local modules left out); torch and jupyter_scale always.
    A local version label (torch's +cpu) is left out: which build is the machine's choice.
    `extras`: distribution -> the extras to ask for (ray -> "default")."""
    extras = extras or {}
    provided = importlib.metadata.packages_distributions()
    lines: dict[str, str] = {}
    unknown = []
    for module in sorted({*modules, "torch", "jupyter_scale"} - set(local)):
        if module in sys.stdlib_module_names or module == "__main__" or module.startswith("_"):
            continue
        distributions = provided.get(module)
        if not distributions:  # an editable install maps no module: a distribution of its name, then
            try:
                importlib.metadata.distribution(module)
                distributions = [module]
            except importlib.metadata.PackageNotFoundError:
                pass
        if not distributions:
            unknown.append(module)
            continue
        for dist_name in distributions:
            try:
                version = importlib.metadata.version(dist_name).split("+")[0]
                extra = f"[{extras[dist_name.lower()]}]" if dist_name.lower() in extras else ""
                lines[dist_name.lower()] = f"{dist_name}{extra}=={version}"
            except importlib.metadata.PackageNotFoundError:
                unknown.append(module)
    return sorted(lines.values(), key=str.lower) + [
        f"# {m}: imported, but no installed distribution provides it" for m in unknown]


def local_modules(modules: Iterable[str], root: Path) -> dict[str, Path]:
    """Modules the script imports from files under `root` (the notebook's directory, not
    an installed package): they travel with the script."""
    found = {}
    for name in modules:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if not path:
            continue
        path = Path(path).resolve()
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            path.relative_to(root.resolve())
        except ValueError:
            continue
        found[name] = path.parent if path.name == "__init__.py" else path
    return found


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# --------------------------------------------------------------------------------------
# train.py
# --------------------------------------------------------------------------------------


def _cell_name(number: int | None) -> str:
    return f"In [{number}]" if number else "a cell"


def script_text(plan: ScriptPlan, *, seed: int, automatic: bool, cell: int | None, title: str) -> str:
    """train.py: imports, literals, the job's start, the notebook's code, the saved values,
    then the cell with the names a %%distribute cell sees."""
    where = f"In [{cell}]" if cell else "a %%distribute cell"
    parts = [f'"""{title}\n\nExported by jupyter_scale from {where}: README.md says how to run it (torchrun,\n'
             "Slurm, Kubeflow, KubeRay). Without torchrun it runs as one process, as the cell runs\n"
             "without %%distribute.\n"
             '"""\n',
             "import jupyter_scale.script\n"]
    imports = [s.source for s in plan.import_statements.values()] + [line + "\n" for line in plan.imports.values()]
    if imports:
        parts.append("".join(imports))
    if plan.literals:
        parts.append("# The notebook's values, as they were at export\n" +
                     "".join(f"{name} = {text}\n" for name, text in plan.literals.items()))
    options = f"seed={seed}" + ("" if automatic else ", automatic=False")
    mode = ("automatic mode (the same seed on every rank,\n# DataLoaders sharded, gradients averaged at each optimizer "
            "step)" if automatic else "no automatic mode (--manual)")
    start = (f"# As under %%distribute: the process group from torchrun's variables and {mode}.\n"
             f"_job = jupyter_scale.script.start({options})\n")
    if plan.reads_injected:
        start += "rank, world_size, local_rank, device, report = _job.names()\n"
    parts.append(start)
    parts += _by_cell(plan.statements)
    if plan.values:
        parts.append('_saved = _job.load("values.pt")  # the notebook\'s values, saved at export\n' +
                     "".join(f'{name} = _saved["{name}"]\n' for name in plan.values))
    parts += _by_cell(plan.after_load)
    parts.append(f"# The cell ({where}): every rank seeded alike, and the names a %%distribute cell sees.\n"
                 "rank, world_size, local_rank, device, report = _job.cell()\n\n" + plan.body.strip("\n") + "\n")
    models = ", ".join(f"{name}={name}" for name in plan.models)
    parts.append(f"_job.finish({models})  # rank 0 saves the models' weights in output/\n")
    return "\n".join(parts)


def _by_cell(statements: list[Statement]) -> list[str]:
    """The statements, a block per notebook cell, each under its cell's name."""
    blocks: list[str] = []
    cell_of = None
    for statement in statements:
        if statement.cell_index != cell_of:
            cell_of = statement.cell_index
            blocks.append(f"# {_cell_name(statement.cell)}\n")
        blocks[-1] += statement.source
    return blocks
