"""Library objects that look at the process once, when they are built: rebuilt where they land.

Some objects read the world they are built in (how many processes train, which one this
is, the device) at construction and keep what they saw: transformers' `TrainingArguments`
caches its device and an accelerate `PartialState` of one process (`_setup_devices`, a
cached property); accelerate's `PartialState`, `AcceleratorState` and `GradientState` are
per-process singletons whose pickle is a frozen copy of the notebook's; an `Accelerator`
holds those; a `Trainer` holds an `Accelerator`, `TrainerState`'s process flags, and weak
references that cannot be pickled. Built in the notebook and sent as they are, they train
on a worker as one process among N (a loss twice as large, gradients summed twice) or
cannot be sent at all.

Shipped (kernel to workers, or a value pulled back), an instance of a registered class is
therefore not pickled by its state but rebuilt on arrival by calling its class again, with
what it was built from, as if the code that built it ran there:

- `arguments="fields"` (a dataclass such as `TrainingArguments`): its init fields as they
  are now, so a field set after construction (`args.learning_rate = ...`) travels too;
- `arguments=None`: the arguments it was built with, recorded when it was built (for that,
  `watch()` patches the class's `__new__`, which sees the outermost call's arguments even
  for a subclass, and its `__init__`, which confirms that construction ran: a copy made by
  `copy` or `pickle` was not built and has no arguments). Changes made to the object after
  it was built (a callback added) do not travel;
- a function of the object answering `(args, kwargs)`.

The arguments travel in the same pickle stream as everything else: a model or a dataset
that is a notebook name stays that name's object on the workers.

Another library registers its classes the same way: `rebuild_on_workers("package.module.Class")`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal

from . import patches

Arguments = Callable[[Any], tuple[tuple, dict]]

# "module.Class" -> how its instances' construction arguments are read (see the module's doc).
_REGISTERED: dict[str, str | Arguments | None] = {
    "transformers.training_args.TrainingArguments": "fields",
    "transformers.trainer.Trainer": None,
    "accelerate.accelerator.Accelerator": None,
    "accelerate.state.PartialState": None,
    "accelerate.state.AcceleratorState": None,
    "accelerate.state.GradientState": None,
}
# Per type met: its registered class and how, or None (weak: notebook classes come and go).
_how: weakref.WeakKeyDictionary[type, tuple[type, str | Arguments | None] | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_watching = False  # recording constructions in this process (the kernel, after `watch()`)
# id(object) -> [weak reference, args, kwargs, built]: what each instance of a recorded class
# was made with, `built` once its __init__ ran.
_records: dict[int, list] = {}


def rebuild_on_workers(class_path: str, arguments: str | Arguments | None = None) -> None:
    """Instances of `class_path` ("package.module.Class", and of its subclasses) are rebuilt
    wherever they are shipped, instead of being pickled with the state they hold.

    `arguments`: None (the arguments they were built with; record them by registering before
    they are built), "fields" (a dataclass's init fields as they are now), or a function of
    the object returning `(args, kwargs)`.
    """
    if arguments is not None and arguments != "fields" and not callable(arguments):
        raise ValueError(f"arguments must be None, 'fields' or a function, not {arguments!r}")
    with _lock:
        _REGISTERED[class_path] = arguments
        _how.clear()
    if _watching:
        _patch_loaded()


def reduce(obj: Any) -> tuple | None:
    """A shipping pickler's reduction of `obj`: rebuilt on arrival, or None (pickled as usual)."""
    kind = type(obj)
    found: tuple[type, str | Arguments | None] | None | Literal[False] = _how.get(kind, False)
    if found is False:
        found = _how[kind] = _registered_base(kind)
    if found is None:
        return None
    base, how = found
    if how == "fields":
        args, kwargs = (), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    elif callable(how):
        args, kwargs = how(obj)
    else:
        record = _records.get(id(obj))
        if record is None or record[0]() is not obj or not record[3]:
            if not _watching:
                return None  # a worker pulling a value back: as before
            raise TypeError(f"jupyter_scale cannot tell what this {kind.__name__} was built from (it was built "
                            "before %load_ext jupyter_scale, or copied), and as it is it would not work on the "
                            "workers: build it again after %load_ext jupyter_scale")
        args, kwargs = record[1], record[2]
    return _rebuild, (kind, args, kwargs)


def _rebuild(kind: type, args: tuple, kwargs: dict) -> Any:
    """On arrival: the object, built here."""
    return kind(*args, **kwargs)


def _registered_base(kind: type) -> tuple[type, str | Arguments | None] | None:
    for cls in kind.__mro__:  # the most derived registered class decides
        path = f"{cls.__module__}.{cls.__qualname__}"
        if path in _REGISTERED:
            return cls, _REGISTERED[path]
    return None


# --------------------------------------------------------------------------------------
# Recording constructions (kernel side)
# --------------------------------------------------------------------------------------


_IMPORTS = patches.Patch("sys.meta_path", "a registered class is patched as soon as its module is imported",
                         patches.LIBRARIES)
# Per class patched: its __new__ and __init__ (weak: a class that goes takes its record along).
_patched: weakref.WeakKeyDictionary[type, tuple[patches.Patch, patches.Patch]] = weakref.WeakKeyDictionary()


def watch() -> None:
    """Record the constructions of registered classes in this process from now on: those
    imported already now, the others when their module is imported. Idempotent."""
    global _watching
    with _lock:
        if _watching:
            return
        _watching = True
        _IMPORTS.hook(_add_import_watch)
    _patch_loaded()


def unwatch() -> None:
    """Stop recording (the extension unloaded): every class patched by `watch` as it was."""
    global _watching
    with _lock:
        _watching = False
        patches.remove_all(patches.LIBRARIES)


def _add_import_watch() -> Callable[[], None]:
    finder = _ImportWatch()
    sys.meta_path.insert(0, finder)

    def remove() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    return remove


def _patch_loaded() -> None:
    for path, how in list(_REGISTERED.items()):
        module, _, name = path.rpartition(".")
        if how is None and module in sys.modules:
            cls = getattr(sys.modules[module], name, None)
            if isinstance(cls, type):
                _record_constructions(cls)


def _record_constructions(cls: type) -> None:
    if cls not in _patched:
        path = f"{cls.__module__}.{cls.__qualname__}"
        _patched[cls] = (
            patches.Patch(f"{path}.__new__", "records what each object is built from, to build it again on the "
                          "workers", patches.LIBRARIES),
            patches.Patch(f"{path}.__init__", "notes that the object was built (a copy was not)", patches.LIBRARIES))
    new, init = _patched[cls]
    new.install(_recording_new, owner=cls)
    init.install(_noting_init, owner=cls)


def _recording_new(original_new: Callable) -> staticmethod:
    def __new__(kind, *args, **kwargs):
        obj = original_new(kind) if original_new is object.__new__ else original_new(kind, *args, **kwargs)
        try:
            key = id(obj)
            ref = weakref.ref(obj, lambda _, key=key: _forget(key, ref))
        except TypeError:  # no weak references to it: not recorded (then it cannot be shipped)
            return obj
        _records[key] = [ref, args, kwargs, False]
        return obj

    return staticmethod(__new__)


def _noting_init(original_init: Callable) -> Callable:
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        record = _records.get(id(self))
        if record is not None and record[0]() is self:
            record[3] = True  # built (a copy's __new__ is never followed by __init__)

    return functools.update_wrapper(__init__, original_init)  # inspect.signature shows the library's own


def _forget(key: int, ref: weakref.ref) -> None:
    record = _records.get(key)
    if record is not None and record[0] is ref:
        del _records[key]


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Patches a registered class as soon as its module has run: before the notebook builds one."""

    def find_spec(self, fullname, path, target=None):
        if not any(p.rpartition(".")[0] == fullname and how is None for p, how in _REGISTERED.items()):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _patch_loaded()

        loader.exec_module = exec_module  # this spec's own loader object
        return spec
