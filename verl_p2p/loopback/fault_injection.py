"""Fault injection into a loopback engine's control plane: a TEST AND SOAK FACILITY of the CPU stand-in only.

Tests and `verl-p2p soak` arm faults on a running LoopbackEngine (`engine.faults`): the next `times` calls of a
route answer a canned HTTP error, or are held `seconds` before being served as usual (a slow server: the call
still takes effect, after the client may have given up). Rank faults (kill, freeze) are LoopbackEngine methods.
Nothing outside `verl_p2p.loopback` and the soak command imports this module; no production path reaches it
(tests/test_soak.py checks the imports).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class InjectedFault:
    """One armed fault on one route: a delay, then (when `status` is set) a canned error instead of the answer."""

    path: str
    status: int | None
    message: str
    delay_s: float = 0.0
    times: int | None = 1  # calls still affected; None: until cleared

    def body(self) -> dict:
        """The answer body, shaped as SGLang's FastAPI app shapes that status."""
        if self.status == 404:
            return {"detail": self.message}
        return {"error": {"message": self.message}}


class LoopbackFaults:
    """The faults armed on one loopback engine's control plane (thread-safe; consumed call by call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, list[InjectedFault]] = {}
        self.fired: list[tuple[str, int | None, str]] = []  # (path, status, message) of every fault that fired

    def fail(self, path: str, status: int, message: str, times: int | None = 1, delay_s: float = 0.0) -> None:
        """The next `times` calls of `path` answer `status` with `message` (after `delay_s`)."""
        self._arm(InjectedFault(path, int(status), message, float(delay_s), times))

    def slow(self, path: str, seconds: float, times: int | None = 1) -> None:
        """The next `times` calls of `path` are held `seconds`, then served as usual."""
        self._arm(InjectedFault(path, None, f"held {seconds:g} s", float(seconds), times))

    def clear(self, path: str | None = None) -> None:
        with self._lock:
            if path is None:
                self._armed.clear()
            else:
                self._armed.pop(path, None)

    def armed(self) -> list[InjectedFault]:
        with self._lock:
            return [f for faults in self._armed.values() for f in faults]

    def take(self, path: str) -> InjectedFault | None:
        """The fault this call of `path` gets (consuming one of its `times`), or None."""
        with self._lock:
            faults = self._armed.get(path)
            if not faults:
                return None
            fault = faults[0]
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    faults.pop(0)
            self.fired.append((path, fault.status, fault.message))
            return fault

    def _arm(self, fault: InjectedFault) -> None:
        if fault.times is not None and fault.times < 1:
            raise ValueError(f"times={fault.times} must be >= 1 (or None: until cleared)")
        with self._lock:
            self._armed.setdefault(fault.path, []).append(fault)
