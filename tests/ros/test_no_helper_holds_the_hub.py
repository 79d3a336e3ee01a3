"""No helper of the SDK holds the `Hub` (ros/client/hub.py's docstring): starting from what
a connected `Hub` keeps, nothing its helpers keep leads back to it, whether as an
attribute, in a container, as a bound method, or in a closure. The helpers get the narrow
things they use (a holder name, a watch opener, the orchestrator), so a `Publication` or a
`Held` that outlives a use of its client never keeps the client's parts alive through it."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable

import torch

import ros

OURS = ("ros.", "transport.", "consistency.", "tensorhub.")


def _kept(obj: object) -> Iterable[tuple[str, object]]:
    """What `obj` keeps that could lead back to the client: the attributes of our own
    objects, the items of containers, a bound method's object, a closure's cells."""
    if isinstance(obj, types.MethodType):
        yield "__self__", obj.__self__
    elif isinstance(obj, types.FunctionType):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True):
            yield name, cell.cell_contents
        yield from (("default", d) for d in obj.__defaults__ or ())
    elif isinstance(obj, functools.partial):
        yield "func", obj.func
        yield from (("arg", a) for a in obj.args)
        yield from obj.keywords.items()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from (("[]", item) for item in obj)
    elif type(obj).__module__.startswith(OURS):
        yield from getattr(obj, "__dict__", {}).items()
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                yield name, getattr(obj, name)


def _paths_to(target: object, roots: Iterable[tuple[str, object]]) -> list[str]:
    """Every path from `roots` that reaches `target` (each object followed once)."""
    seen: set[int] = set()
    todo = [(name, obj) for name, obj in roots]
    found = []
    while todo:
        path, obj = todo.pop()
        if obj is target:
            found.append(path)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        todo.extend((f"{path}.{name}", kept) for name, kept in _kept(obj))
    return found


def test_nothing_a_hub_keeps_leads_back_to_it(connect: Callable[..., ros.Hub]) -> None:
    hub = connect()
    pub = hub.publish("m", 1, {"w": torch.zeros(1024)})
    held = connect().fetch("m", 1)
    roots = [*vars(hub).items(), ("publication", pub), ("held", held)]
    assert len(roots) > 10  # the walk starts from every part the client built
    assert _paths_to(hub, roots) == []
    assert _paths_to(hub, [("hub", hub)]) == ["hub"]  # the walk finds what it looks for
    held.release()
    pub.release()
