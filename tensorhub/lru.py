"""A thread-safe LRU map bounded by the summed size of its values.

Both sides cache manifests (immutable per version): the hub per replica, the SDK per client.
One small class serves both, so their bounds behave alike.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SizedLru(Generic[K, V]):
    """Values kept while their summed `size` stays within `limit`; least recently used go
    first. A value larger than the whole limit is not kept at all."""

    def __init__(self, limit: int, size: Callable[[V], int]) -> None:
        self._limit, self._size = limit, size
        self._lock = threading.Lock()
        self._items: OrderedDict[K, V] = OrderedDict()
        self._used = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        size = self._size(value)
        if size > self._limit:
            return  # larger than the whole cache: not kept
        with self._lock:
            self._pop(key)
            self._items[key] = value
            self._used += size
            while self._used > self._limit:
                _, dropped = self._items.popitem(last=False)
                self._used -= self._size(dropped)

    def pop(self, key: K) -> None:
        with self._lock:
            self._pop(key)

    def _pop(self, key: K) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._used -= self._size(old)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def used(self) -> int:
        with self._lock:
            return self._used
