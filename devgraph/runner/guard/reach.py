"""Where the tensors a forward uses live: the paths from the forward to each of them, by name.

A forward reaches its weights and caches through objects and through the code it calls: the module a bound
method belongs to, the variables a closure captured, a ``functools.partial``'s arguments, the globals its
code names (module-level tensors, lists, dicts and objects), and the same again for every helper it calls
by a global name, a closure variable or ``self.<method>`` (their closures and globals). From there the walk
follows child modules, parameters, buffers, module attributes public and private (``self._kv_cache``), list,
tuple and dict items, and the attributes of plain objects, slotted ones included (``__slots__``,
``@dataclass(slots=True)``), a bounded number of steps, and returns for every tensor storage the paths that
lead to it (``ReferenceModel.layers.3.o_proj``), each a chain of :class:`Link` s: what held what when the
graphs were captured. A link can tell whether its container still holds the same object.

What it does not follow is listed in :data:`NOT_FOLLOWED` (shown by ``inspect()`` and docs/user-guide.md).
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from devgraph.runner.guard.events import watch_module

__all__ = ["Link", "Place", "Reach", "reach"]

#: Kinds of link whose assignment runs torch's module registration hooks (an event, no per-step check).
HOOKED = frozenset({"parameter", "buffer", "module"})
#: A ``__slots__`` attribute of an object without a ``__dict__`` entry for it (read with ``getattr``).
SLOT = "slot"
#: What the walk does not follow (a tensor reached only through one of these is watched by its storage, if
#: the observed warm-up used it, but a replacement there is not named).
NOT_FOLLOWED = (
    "dict keys, sets and weak references",
    "attributes computed on access (properties, __getattr__) and class attributes",
    "objects of C extensions without __dict__ or __slots__",
    "forward hooks and what torch.compile or a library keeps inside its own caches",
    "containers longer than 4096 items, and objects past 20000 or 12 levels deep",
)
#: An attribute its owner rebinds on purpose, keeping what it replaced alive for the graphs captured on it
#: (the class lists it in ``__devgraph_rebinds__``): a new object there is no change; the old one freed is.
KEPT = "kept"
#: The class attribute that lists such attribute names.
REBINDS = "__devgraph_rebinds__"
#: The walk stops after this many objects, this deep, and skips containers longer than this.
MAX_OBJECTS = 20000
MAX_DEPTH = 12
MAX_ITEMS = 4096


def _strong(value: Any) -> Callable[[], Any]:
    return lambda: value


#: What a tensor link's ``value()`` returns: the tensor is not referenced, its link compares by id.
_BY_ID = object()


def _ref(value: Any) -> Callable[[], Any]:
    """A weak reference where the object allows one (modules, most objects), else a strong one (lists,
    dicts, tuples), as a callable returning the object. Tensors get neither: torch's swap mode
    (``torch.__future__.set_swap_module_params_on_conversion(True)``) makes ``load_state_dict()`` swap each
    parameter with ``torch.utils.swap_tensors``, which refuses a tensor that has a weak reference, and a
    strong one would keep a dropped model's weights alive. A tensor link is checked by identity (its id);
    its storage's own weak reference (:func:`~devgraph.runner.guard.events.storage_ref`) tells when it
    dies."""
    if isinstance(value, torch.Tensor):
        return lambda: _BY_ID
    try:
        return weakref.ref(value)
    except TypeError:
        return _strong(value)


@dataclass(frozen=True)
class Link:
    """``owner`` held ``value`` under ``key`` (a parameter, buffer or child module of a module; an attribute
    of an object; an item of a list, tuple or dict; a closure cell's contents) when the graphs were captured.

    Modules are held weakly (the guard must not keep a dropped model's weights alive); other containers
    strongly (lists and dicts cannot be referenced weakly).
    """

    kind: str
    key: Any
    owner: Callable[[], Any]
    value: Callable[[], Any]
    value_id: int

    def container(self) -> Any:
        """The mapping or sequence ``key`` indexes (``None``: the owner is gone)."""
        owner = self.owner()
        if owner is None:
            return None
        if self.kind == "parameter":
            return owner._parameters
        if self.kind == "buffer":
            return owner._buffers
        if self.kind == "module":
            return owner._modules
        if self.kind in ("attribute", KEPT):
            return owner.__dict__
        return owner

    def current(self) -> Any:
        """What the owner holds under ``key`` now (``_MISSING`` when nothing)."""
        if self.kind == "cell":
            owner = self.owner()
            try:
                return owner.cell_contents
            except ValueError:  # an emptied cell
                return _MISSING
        if self.kind == SLOT:
            return getattr(self.owner(), self.key, _MISSING)
        container = self.container()
        if container is None:
            return _MISSING
        try:
            return container[self.key]
        except (KeyError, IndexError, TypeError):
            return _MISSING

    def holds(self, current: Any) -> bool:
        """Whether ``current`` is the object the owner held at capture."""
        value = self.value()
        return id(current) == self.value_id if value is _BY_ID else current is value

    @property
    def hooked(self) -> bool:
        return self.kind in HOOKED


_MISSING = object()


@dataclass(frozen=True)
class Place:
    """One path from the forward to a tensor: the links along it and the name reached after each."""

    links: tuple[Link, ...]
    names: tuple[str, ...]

    @property
    def path(self) -> str:
        return self.names[-1]

    def broken_at(self) -> str | None:
        """Where the path breaks now, in words (``None``: the whole path holds what it held)."""
        for link, name in zip(self.links, self.names[-len(self.links) :] if self.links else (), strict=True):
            if link.kind == KEPT:
                continue  # rebound on purpose; its old object dying is what the guard reports instead
            current = link.current()
            if current is _MISSING or current is None:
                return f"{name} is gone"
            if not link.holds(current):
                return f"{name} is another object now"
        return None


@dataclass
class Reach:
    """What the walk found: paths per storage (by data pointer) and every module on the way."""

    places: dict[int, list[Place]] = field(default_factory=dict)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # one tensor per storage, for its facts
    module_tensors: set[int] = field(default_factory=set)  # storages of parameters and buffers
    modules: int = 0
    complete: bool = True  # False when a bound stopped the walk


def _storage_ptr(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # meta, sparse and other storage-less tensors
        return 0


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` uses, its nested functions' and comprehensions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _followed(fn: Any) -> bool:
    """Whether a helper the forward calls is walked: Python code outside torch and devgraph's machinery."""
    module = getattr(fn, "__module__", None) or ""
    return module.partition(".")[0] != "torch" and not module.startswith(_OWN)


def _module_forwards(module: nn.Module) -> list[tuple[Any, type]]:
    """``(forward function, class)`` of every distinct class among ``module`` and its descendants."""
    found: dict[int, tuple[Any, type]] = {}
    for sub in module.modules():
        forward = getattr(type(sub), "forward", None)
        if isinstance(forward, types.FunctionType):
            found.setdefault(id(forward), (forward, type(sub)))
    return list(found.values())


def _roots(forward: Any) -> Iterator[tuple[str, Link | None, Any]]:
    """``(name, link to it or None, object)`` for what the forward and the helpers it calls hold directly:
    bound objects, closure variables, ``partial`` arguments and the module globals their code names."""
    seen: set[int] = set()
    # What to walk, and the class its ``self.<name>`` calls look up (None: not a method).
    stack: list[tuple[Any, type | None]] = [(forward, None)]
    while stack:
        fn, methods = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(fn, functools.partial):
            stack.append((fn.func, None))
            for i, arg in enumerate(fn.args):
                yield f"partial[{i}]", None, arg
            for name, arg in fn.keywords.items():
                yield name, None, arg
            continue
        owner = getattr(fn, "__self__", None)
        if owner is not None and not isinstance(owner, types.ModuleType):
            yield type(owner).__name__, None, owner
            methods = type(owner)
            if isinstance(owner, nn.Module):
                stack.extend(_module_forwards(owner))
            fn = getattr(fn, "__func__", fn)
            if id(fn) in seen:
                continue
            seen.add(id(fn))
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            stack.append((wrapped, methods))
        code = getattr(fn, "__code__", None)
        if code is None:
            if isinstance(fn, nn.Module):
                yield type(fn).__name__, None, fn
                stack.extend(_module_forwards(fn))  # what runs when it is called: those helpers too
            elif callable(fn) and not isinstance(fn, type):
                call = next(
                    (k.__dict__["__call__"] for k in type(fn).__mro__ if "__call__" in k.__dict__), None
                )
                if isinstance(call, types.FunctionType) and _followed(call):
                    yield type(fn).__name__, None, fn
                    stack.append((call, type(fn)))
            continue
        if not _followed(fn):
            continue
        qualname = getattr(fn, "__name__", "forward")
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            yield (
                f"{qualname}.{name}",
                Link("cell", None, _strong(cell), _ref(value), id(value)),
                value,
            )
            if callable(value) and not isinstance(value, (nn.Module, torch.Tensor)):
                stack.append((value, None))
        module_globals = getattr(fn, "__globals__", {})
        for name in sorted(_names(code)):
            if methods is not None:  # self.<helper>(): the helper's closures and globals too
                try:
                    method = getattr(methods, name, None)
                except Exception:  # a class whose attribute lookup runs code of its own
                    method = None
                method = getattr(method, "__func__", method)
                if isinstance(method, types.FunctionType):
                    stack.append((method, methods))
            if name not in module_globals:
                continue
            value = module_globals[name]
            if isinstance(value, (types.FunctionType, functools.partial)):
                stack.append((value, None))  # a helper it calls by name
            elif _interesting(value):
                link = Link("item", name, _strong(module_globals), _ref(value), id(value))
                yield name, link, value


#: devgraph's own machinery (runners, backends, platforms, the guard itself): what it holds is devgraph's,
#: and its bookkeeping changes between walks. Objects of the layers above (an integration's decoder, the
#: serving engine) hold the model and are walked.
_OWN = ("devgraph.runner", "devgraph.strategies", "devgraph.platforms", "devgraph.contract", "devgraph.ranks",
        "devgraph.flag", "devgraph.registry")  # fmt: skip


#: Objects of the standard library's machinery (loggers, locks, threads, executors) hold no model state;
#: plain holders (``types.SimpleNamespace``, dataclasses, named tuples) do and are walked.
_MACHINERY = frozenset(sys.stdlib_module_names) - {"types", "collections", "dataclasses"}


def _interesting(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, nn.Module, list, tuple, dict)):
        return True
    if isinstance(value, (str, bytes, int, float, bool, type, types.ModuleType, types.FunctionType)):
        return False
    module = type(value).__module__ or ""
    top = module.partition(".")[0]
    if module.startswith(_OWN) or top in _MACHINERY or top.lstrip("_") in _MACHINERY:
        return False
    return (hasattr(value, "__dict__") or bool(_slots(type(value)))) and not callable(value)


#: What every ``nn.Module`` holds by itself (hooks, its tables): not model state.
_MODULE_OWN = frozenset(vars(nn.Module()))


def _slots(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` names of ``cls`` and its bases (``__dict__`` and ``__weakref__`` left out)."""
    names: list[str] = []
    for klass in cls.__mro__:
        declared = klass.__dict__.get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


def _attributes(obj: Any, skip: frozenset[str]) -> Iterator[tuple[str, str, Any]]:
    """``(kind, name, value)`` of an object's instance attributes: its ``__dict__``, then its slots."""
    kept = getattr(type(obj), REBINDS, ())
    for name, value in getattr(obj, "__dict__", {}).items():
        if name not in skip and not name.startswith("__") and _interesting(value):
            yield KEPT if name in kept else "attribute", name, value
    for name in _slots(type(obj)):
        value = getattr(obj, name, _MISSING)
        if value is not _MISSING and not name.startswith("__") and _interesting(value):
            yield SLOT, name, value


def _children(obj: Any) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(kind, key, owner for the link, value)`` of what ``obj`` holds."""
    if isinstance(obj, nn.Module):
        for kind, table in (
            ("parameter", obj._parameters),
            ("buffer", obj._buffers),
            ("module", obj._modules),
        ):
            for name, value in table.items():
                if value is not None:
                    yield kind, name, obj, value
        for kind, name, value in _attributes(obj, _MODULE_OWN):
            yield kind, name, obj, value
    elif isinstance(obj, (list, tuple)):
        if len(obj) <= MAX_ITEMS:
            for i, value in enumerate(obj):
                if _interesting(value):
                    yield "item", i, obj, value
    elif isinstance(obj, dict):
        if len(obj) <= MAX_ITEMS:
            for key, value in obj.items():
                if isinstance(key, (str, int)) and _interesting(value):
                    yield "item", key, obj, value
    elif not isinstance(obj, torch.Tensor):
        for kind, name, value in _attributes(obj, frozenset()):
            yield kind, name, obj, value


def _owner_ref(kind: str, owner: Any) -> Callable[[], Any]:
    # Modules weakly (their dicts are read through them); lists, dicts and tuples strongly.
    return _ref(owner) if kind in HOOKED or kind in ("attribute", KEPT, SLOT) else _strong(owner)


def reach(forward: Any) -> Reach:
    """Walk from ``forward`` to every tensor it can reach; modules on the way become watched (their
    parameter, buffer and child-module assignments are events)."""
    found = Reach()
    visited: set[int] = set()
    stack: list[tuple[tuple[str, ...], tuple[Link, ...], Any, int]] = [
        ((name,), (link,) if link is not None else (), value, 0) for name, link, value in _roots(forward)
    ]
    while stack:
        names, links, obj, depth = stack.pop()
        path = names[-1]
        if isinstance(obj, torch.Tensor):
            ptr = _storage_ptr(obj)
            if ptr:
                found.places.setdefault(ptr, []).append(Place(links, names))
                found.tensors.setdefault(ptr, obj)
                if links and links[-1].kind in ("parameter", "buffer"):
                    found.module_tensors.add(ptr)
            continue
        if id(obj) in visited:
            continue
        if len(visited) >= MAX_OBJECTS or depth >= MAX_DEPTH:
            found.complete = False
            continue
        visited.add(id(obj))
        if isinstance(obj, nn.Module):
            watch_module(obj)
            found.modules += 1
        for kind, key, owner, value in _children(obj):
            link = Link(kind, key, _owner_ref(kind, owner), _ref(value), id(value))
            name = f"{path}[{key!r}]" if kind == "item" else f"{path}.{key}"
            stack.append(((*names, name), (*links, link), value, depth + 1))
    return found
