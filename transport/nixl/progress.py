"""Driving a NIXL agent's UCX worker only while transfers need it.

NIXL's own progress thread (nixl 1.5.1's Python `nixl_agent` sets its delay to 0) polls its
worker without pause: one CPU core per agent, idle or not, so every client that enabled
NIXL burned two (its holder's agent and its reader's). Agents here are made without it
(`transport.nixl.holder.new_agent`). A reader drives its own worker while it waits for a
READ (`check_xfer_state` progresses it). A holder must progress too, for UCX's connection
set-up and, over its TCP transport, to serve the READs in software; it does so through a
`Pump`: one thread per holder that calls `get_new_notifs` (which progresses the agent's
backends) on each agent that has a batch in flight, and sleeps on a condition when none
has, so an idle holder costs no CPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

SPIN = 20e-6  # seconds between passes while a batch is in flight


class Pump:
    """Progresses the agents that have a batch in flight (`active`), from one thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._active: dict[int, tuple[Any, int]] = {}  # id(agent) -> (agent, batches)
        self._thread: threading.Thread | None = None
        self._stopped = False

    @contextlib.contextmanager
    def active(self, agent: Any) -> Iterator[None]:
        """Progress `agent` until the block ends (nested and concurrent uses count)."""
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"{self._name} is stopped")
            held, n = self._active.get(id(agent), (agent, 0))
            self._active[id(agent)] = (held, n + 1)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                held, n = self._active[id(agent)]
                if n > 1:
                    self._active[id(agent)] = (held, n - 1)
                else:
                    del self._active[id(agent)]

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread (after its current pass)."""
        with self._cond:
            self._stopped = True
            self._active.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                agents = [agent for agent, _ in self._active.values()]
            self._progress(agents)
            # Hold no agent while waiting: a retired one closes with its last reference,
            # and its closing is what disconnects its readers.
            del agents
            time.sleep(SPIN)

    @staticmethod
    def _progress(agents: list[Any]) -> None:
        for agent in agents:
            try:
                agent.get_new_notifs()
            except Exception as exc:  # NIXL's own errors: logged, the pump goes on
                log.debug("NIXL progress of %s failed: %r", agent.name, exc)
