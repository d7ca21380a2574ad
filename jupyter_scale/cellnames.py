"""Which notebook names a cell reads, stores and deletes, read from its code.

`free_names` are the names a cell reads before (or without) binding them, in the order
it first reads them, the names that functions and classes it defines read at call time
included; `stored_names` what it binds and deletes at its top level; `global_names` the
globals a compiled function reads (a notebook function the cell calls, followed by the
shipping plan).
"""

from __future__ import annotations

import ast
import dis
from collections.abc import Iterable
from types import CodeType


class _FreeNames(ast.NodeVisitor):
    """Collect the names a cell reads before it binds them itself.

    Top-level statements are walked in evaluation order (the value of an assignment
    before its targets, a loop's iterable before its target). A name counts as bound only
    when straight-line code assigned it; assignments inside `if`/`for`/`while`/`try` may
    not run, so a later read still takes the notebook's value when there is one. Reads
    inside functions, lambdas, classes and comprehensions defined in the cell are global
    reads at call time: free unless the cell binds that name at top level somewhere.
    Comprehensions run where they stand, so their reads count at that point.
    """

    def __init__(self) -> None:
        self.free: list[str] = []  # ordered, for stable error messages
        self.bound: set[str] = set()
        self.top_level_stores: set[str] = set()
        self.deferred_reads: list[str] = []
        self.deleted: set[str] = set()  # by a `del` that always runs
        self._conditional = 0

    # -- helpers -------------------------------------------------------------------
    def _read(self, name: str) -> None:
        if name not in self.bound and name not in self.free:
            self.free.append(name)

    def _store(self, name: str) -> None:
        self.top_level_stores.add(name)
        if not self._conditional:
            self.bound.add(name)

    def _conditional_block(self, nodes: Iterable[ast.AST]) -> None:
        self._conditional += 1
        for node in nodes:
            self.visit(node)
        self._conditional -= 1

    def _nested_scope(self, node: ast.AST, local_names: set[str], *, immediate: bool = False) -> None:
        inner = _ScopeReads(local_names, is_class=isinstance(node, ast.ClassDef))
        inner.visit_body(node)
        for name in inner.reads:
            if immediate:
                self._read(name)
            else:
                self.deferred_reads.append(name)

    def _annotations(self, args: ast.arguments, returns: ast.AST | None) -> None:
        # Evaluated when the function is defined, in the enclosing scope.
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None and arg.annotation is not None:
                self.visit(arg.annotation)
        if returns is not None:
            self.visit(returns)

    # -- names ---------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._read(node.id)
        elif isinstance(node.ctx, ast.Store):
            self._store(node.id)
        else:  # Del
            self._read(node.id)
            if not self._conditional:
                self.deleted.add(node.id)

    # -- statements in evaluation order --------------------------------------------
    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self._read(node.target.id)
            self._store(node.target.id)
        else:
            self.visit(node.target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.annotation)
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        # The loop variable is bound wherever the body reads it.
        self.visit(node.target)
        self._conditional_block([*node.body, *node.orelse])

    visit_AsyncFor = visit_For

    def visit_While(self, node: ast.While) -> None:
        self.visit(node.test)
        self._conditional_block([*node.body, *node.orelse])

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self._conditional_block([*node.body, *node.orelse])

    def visit_Try(self, node: ast.Try | ast.TryStar) -> None:
        self._conditional_block([*node.body])
        for handler in node.handlers:
            if handler.type is not None:
                self.visit(handler.type)
            if handler.name:
                self._store(handler.name)  # bound in the handler, where it is read
            self._conditional += 1
            for stmt in handler.body:
                self.visit(stmt)
            self._conditional -= 1
        self._conditional_block([*node.orelse])
        for stmt in node.finalbody:
            self.visit(stmt)

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._store((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name != "*":
                self._store(alias.asname or alias.name)

    # -- nested scopes ---------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        self._annotations(node.args, node.returns)
        self._nested_scope(node, _argument_names(node.args))
        self._store(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in [*node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        self._nested_scope(node, _argument_names(node.args))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        self._nested_scope(node, set())
        self._store(node.name)

    def _visit_comprehension(self, node: ast.AST) -> None:
        # The first iterable is evaluated in the enclosing scope; the rest is nested.
        generators = node.generators  # type: ignore[attr-defined]
        self.visit(generators[0].iter)
        self._nested_scope(node, set(), immediate=True)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _visit_comprehension


class _ScopeReads(ast.NodeVisitor):
    """Reads of a nested scope that are not local to it (so global at run time)."""

    def __init__(self, local_names: set[str], is_class: bool = False) -> None:
        self.local_names = set(local_names)
        self.global_decls: set[str] = set()
        self.loads: list[str] = []
        # A class body's names are not visible inside its methods: their reads skip
        # the class's own local names.
        self.is_class = is_class
        self.method_reads: list[str] = []

    def visit_body(self, node: ast.AST) -> None:
        if isinstance(node, ast.Lambda):
            self.visit(node.body)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            self._comprehension(node.generators, [node.elt])
        elif isinstance(node, ast.DictComp):
            self._comprehension(node.generators, [node.key, node.value])
        else:
            for stmt in node.body:  # type: ignore[attr-defined]
                self.visit(stmt)

    def _comprehension(self, generators, elements) -> None:
        for i, gen in enumerate(generators):
            if i:
                self.visit(gen.iter)
            self.visit(gen.target)
            for cond in gen.ifs:
                self.visit(cond)
        for elt in elements:
            self.visit(elt)

    @property
    def reads(self) -> list[str]:
        own = [n for n in self.loads if n not in self.local_names or n in self.global_decls]
        return own + self.method_reads

    def visit_Global(self, node: ast.Global) -> None:
        self.global_decls.update(node.names)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.loads.append(node.id)
        else:
            self.local_names.add(node.id)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.local_names.add(node.name)
        annotations = [a.annotation for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                                              node.args.vararg, node.args.kwarg] if a is not None]
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults, *annotations, node.returns]:
            if expr is not None:
                self.visit(expr)
        inner = _ScopeReads(_argument_names(node.args))
        inner.visit_body(node)
        (self.method_reads if self.is_class else self.loads).extend(inner.reads)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.local_names.add(node.name)
        for expr in [*node.decorator_list, *node.bases]:
            self.visit(expr)
        inner = _ScopeReads(set(), is_class=True)
        inner.visit_body(node)
        self.loads.extend(inner.reads)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        inner = _ScopeReads(_argument_names(node.args))
        inner.visit_body(node)
        self.loads.extend(inner.reads)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.local_names.add((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self.local_names.add(alias.asname or alias.name)


def _argument_names(args: ast.arguments) -> set[str]:
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    if args.vararg:
        names.add(args.vararg.arg)
    if args.kwarg:
        names.add(args.kwarg.arg)
    return names


def _visited(source: str) -> _FreeNames:
    visitor = _FreeNames()
    for stmt in ast.parse(source).body:
        visitor.visit(stmt)
    return visitor


def stored_names(source: str) -> tuple[list[str], list[str]]:
    """Names `source` binds at its top level (perhaps: in a branch or a loop too), and those
    it deletes there (surely: not in a branch or a loop)."""
    visitor = _visited(source)
    return sorted(visitor.top_level_stores), sorted(visitor.deleted)


def free_names(source: str) -> list[str]:
    """Names `source` reads that it does not bind first, in order of first read.

    Builtins are left out unless the cell could only mean a notebook value (the caller
    intersects with the notebook namespace, which shadows builtins the same way).
    """
    visitor = _visited(source)
    names = list(visitor.free)
    for name in visitor.deferred_reads:
        if name not in visitor.top_level_stores and name not in names:
            names.append(name)
    return names


_GLOBAL_OPS = {"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"}


def global_names(code: CodeType) -> set[str]:
    """The global names `code` (and the functions, classes and comprehensions nested in it)
    reads, writes or deletes."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= global_names(const)
    return names


# Values whose identity nothing can depend on (immutable atoms), that travel by reference
# anyway (classes, modules, dtypes), or by identity token already (tensors).
