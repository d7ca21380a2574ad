"""What jupyter_scale patches in this process, in one registry.

Each patch is declared once, beside its use, with its target, why, and the feature it serves;
it is installed on use, and a second install changes nothing:

    _INIT = patches.Patch("torch.optim.Optimizer.__init__", "why, in one line", patches.AUTOMATIC)
    _INIT.install(lambda original: replacement)

`install` replaces an attribute (`also`: other names bound to the same original too); `hook`
uses a library's own registration and keeps its undo; `during` installs for a `with` block.
`installed()` lists what is in place. `Patch.remove` and `remove_all(feature)` put back the
very object that was there, or nothing where the attribute was inherited; a patch that someone
patched over again stays (removing it would drop theirs), and stays listed.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# Features (what installs a patch), for `remove_all(feature)`; engines and frameworks are
# "engine NAME" and "framework NAME".
AUTOMATIC = "automatic mode"
TORCHRUN = "torchrun compatibility"
MARKS = "collective marks"
INTERRUPTS = "interrupts"
CAPTURE = "output capture"
LIBRARIES = "library objects"
DEBUGGER = "debugger"

_MISSING = object()
_lock = threading.RLock()


@dataclass(frozen=True)
class Record:
    """One patch in place: what it patches, why, and the feature that installed it."""

    target: str
    why: str
    feature: str


@dataclass
class _Site:
    """One attribute replaced; `own`: what the owner's own __dict__ held (_MISSING: inherited)."""

    owner: Any
    name: str
    own: Any
    replacement: Any

    def ours(self) -> bool:
        return _own_value(self.owner, self.name) is self.replacement

    def restore(self) -> None:
        if self.own is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.own)


_installed: dict[Patch, list[_Site] | Callable[[], object]] = {}  # in installation order


class Patch:
    """A declared patch of `target`, "module.Class.attribute" (or, where `install` is given the
    object that holds the attribute, a name for people)."""

    def __init__(self, target: str, why: str, feature: str, *, also: tuple[str, ...] = ()):
        self.target, self.why, self.feature, self.also = target, why, feature, also
        self.original: Any = None  # what `install` replaced (as read through the owner)

    def __repr__(self) -> str:
        return f"<patch of {self.target} ({self.feature})>"

    @property
    def record(self) -> Record:
        return Record(self.target, self.why, self.feature)

    @property
    def is_installed(self) -> bool:
        return self in _installed

    def install(self, make: Callable[[Any], Any], owner: Any = _MISSING) -> Any:
        """Replace the target (an attribute of `owner`, if given) with `make(original)` unless
        this patch is in place already; returns what is in place."""
        with _lock:
            if self not in _installed:
                name = self.target.split()[0].rpartition(".")[2]
                if owner is _MISSING:
                    owner, name = _resolve(self.target)
                self.original = getattr(owner, name)
                replacement = make(self.original)
                sites = [_Site(owner, name, _own_value(owner, name), replacement)]
                for path in self.also:  # where the original is bound by name too
                    also_owner, also_name = _resolve(path)
                    if getattr(also_owner, also_name, None) is self.original:
                        sites.append(_Site(also_owner, also_name, _own_value(also_owner, also_name), replacement))
                for site in sites:
                    setattr(site.owner, site.name, replacement)
                _installed[self] = sites
            found = _installed[self]
            return found[0].replacement if isinstance(found, list) else None

    def hook(self, register: Callable[[], Callable[[], object]]) -> None:
        """A hook put in with the library's own registration: `register()` installs it and
        returns what removes it (a handle's `remove`)."""
        with _lock:
            if self not in _installed:
                _installed[self] = register()

    @contextmanager
    def during(self, make: Callable[[Any], Any]) -> Iterator[Any]:
        """Installed for the `with` block only (unless it was in place before)."""
        before = self.is_installed
        replacement = self.install(make)
        try:
            yield replacement
        finally:
            if not before:
                self.remove()

    def remove(self) -> bool:
        """Put the original back; False (and left in place) where someone patched over ours."""
        with _lock:
            found = _installed.get(self)
            if found is None:
                return True
            if isinstance(found, list):
                if not all(site.ours() for site in found):
                    return False
                for site in found:
                    site.restore()
            else:
                found()
            del _installed[self]
            self.original = None
            return True


def installed(feature: str | None = None) -> list[Record]:
    """The patches in place in this process (of `feature`), in the order they went in."""
    with _lock:
        return [p.record for p in _installed if feature is None or p.feature == feature]


def remove_all(feature: str | Collection[str] | None = None, keep: Collection[str] = ()) -> list[Record]:
    """Remove every patch (of `feature`, or of any of several; not those of a feature in
    `keep`), the latest first; returns those left in place because someone patched over them."""
    features = {feature} if isinstance(feature, str) else feature
    with _lock:
        chosen = [p for p in reversed(_installed) if (features is None or p.feature in features) and p.feature not in keep]
        return [p.record for p in chosen if not p.remove()]


def describe(records: list[Record]) -> str:
    """Records as lines for a person: the targets of each feature and reason, then those."""
    if not records:
        return "  (none)"
    grouped: dict[tuple[str, str], list[str]] = {}
    for r in records:
        grouped.setdefault((r.feature, r.why), []).append(r.target)
    return "\n".join(f"  {', '.join(targets)}\n      [{feature}] {why}" for (feature, why), targets in grouped.items())


def _own_value(owner: Any, name: str) -> Any:
    """The attribute as stored in `owner` itself (a staticmethod stays one), or _MISSING."""
    try:
        return vars(owner).get(name, _MISSING)
    except TypeError:  # no __dict__ (slots): read through
        return getattr(owner, name, _MISSING)


def _resolve(target: str) -> tuple[Any, str]:
    """"a.b.C.attr" -> (the object a.b.C, "attr"), importing modules on the way."""
    parts = target.split(".")
    owner: Any = importlib.import_module(parts[0])
    for depth, part in enumerate(parts[1:-1], start=2):
        found = getattr(owner, part, _MISSING)
        owner = found if found is not _MISSING else importlib.import_module(".".join(parts[:depth]))
    return owner, parts[-1]
