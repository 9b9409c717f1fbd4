"""The loopback engine's lifecycle state machine and its event log (no HTTP, no processes).

Refusals SGLang itself makes (read from 0.5.12 / 0.5.23): begin while a session is open, end without one
(400, success false, SGLang's messages); an invalid pause mode or selector (400).
Refusals SGLang does not make, added where p2p correctness needs them (messages start with "loopback:"):
- release_memory_occupation while generation runs (SGLang asserts the scheduler is idle instead: an error too);
- resume_memory_occupation of a tag that is not released (SGLang's scheduler fails on it with a KeyError).

What SGLang allows, the loopback allows too, and records as a *violation* event (method "LOOPBACK", the
violation's name as path) so a test can see it:
- `resumed_inside_weight_update_session`: continue_generation does not check for an open session, so a
  replica whose weights are half written would serve them;
- `resumed_with_kv_cache_released`: continue_generation does not check the KV cache either;
- `weight_update_began_while_generating`: begin_weight_update does not check that generation is paused;
- `weights_written_while_serving`: a one-sided write landed while generation ran (seen at the next pause: some
  rank's weight digest differs from the one generation started on); SGLang cannot see such writes at all;
- `served_stale_prefix_cache`: generation resumed while the prefix cache holds KV computed with weights that
  have changed since (SGLang empties it on /flush_cache and when the KV cache is released; its own weight
  loaders flush after an update, but one-sided writes bypass them). The cache is tracked as the per-rank
  digest of the weights generation last ran on (None: empty).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
VIOLATION = "LOOPBACK"  # the `method` of violation events
PAUSE_MODES = ("abort", "retract", "in_place")
SELECTORS = ("all", "target", "draft")


class Refused(Exception):
    """An out-of-order or invalid call; `status` is the HTTP code the server answers."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class LifecycleState:
    """What the control plane has been told so far."""

    paused: bool = False
    pause_mode: str | None = None
    released_tags: list[str] = field(default_factory=list)
    session_open: bool = False
    session_selector: str | None = None
    weight_version: str = "default"
    sessions_completed: int = 0
    prefix_cache_from: dict[str, str] | None = None  # rank -> digest of the weights its cached KV came from
    serving_from: dict[str, str] | None = None  # rank -> digest of the weights when generation last started


@dataclass(frozen=True)
class Event:
    """One control-plane call and its outcome, in arrival order."""

    seq: int
    time: float
    method: str
    path: str
    body: dict | None
    status: int
    message: str
    state: dict


class Lifecycle:
    """Thread-safe lifecycle state plus the ordered event log."""

    def __init__(self, weight_version: str = "default"):
        self.state = LifecycleState(weight_version=weight_version)
        self.lock = threading.RLock()
        self._events: list[Event] = []

    # -- event log
    def record(self, method: str, path: str, body: dict | None, status: int, message: str = "") -> Event:
        with self.lock:
            event = Event(len(self._events), time.time(), method, path, body, status, message, asdict(self.state))
            self._events.append(event)
            return event

    def events(self, since: int = 0) -> list[Event]:
        with self.lock:
            return list(self._events[since:])

    # -- transitions (callers hold `lock` across the check, the rank work and the commit)
    def pause(self, mode: str, digests: Callable[[], dict[int, str | None]]) -> list[tuple[str, str]]:
        """Pause; returns the violations to record. `digests` (read only when generation ran) gives every rank's
        weight digest now, to see writes that landed while it served."""
        if mode not in PAUSE_MODES:
            raise Refused(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        violations = []
        if not self.state.paused and self.state.serving_from is not None:
            now = digests()
            changed = sorted(
                r for r, d in now.items() if d is not None and self.state.serving_from.get(str(r)) not in (None, d)
            )
            if changed:
                violations.append(
                    (
                        "weights_written_while_serving",
                        f"loopback: the weights of rank(s) {changed} changed while generation ran (a write into a "
                        "serving engine: its answers mixed old and new weights)",
                    )
                )
        self.state.paused, self.state.pause_mode = True, mode
        return violations

    def resume_generation(self, digests: dict[int, str | None]) -> list[tuple[str, str]]:
        """Resume (as SGLang does, whatever the state); returns the violations (name, message) to record.
        `digests`: every rank's current weight digest (None: the rank did not answer)."""
        violations = []
        if self.state.session_open:
            violations.append(
                (
                    "resumed_inside_weight_update_session",
                    "loopback: generation resumed while a weight-update session is open: the weights may be half "
                    "written (SGLang does not check)",
                )
            )
        if "kv_cache" in self.state.released_tags:
            violations.append(
                ("resumed_with_kv_cache_released", "loopback: generation resumed while the KV cache is released")
            )
        cached = self.state.prefix_cache_from
        changed = sorted(
            r
            for r, d in digests.items()
            if cached is not None and d is not None and cached.get(str(r)) not in (None, d)
        )
        if changed:
            violations.append(
                (
                    "served_stale_prefix_cache",
                    f"loopback: generation resumed with a prefix cache computed from older weights (rank(s) "
                    f"{changed} changed since the cache was last flushed)",
                )
            )
        current = dict(cached or {})
        current.update({str(r): d for r, d in digests.items() if d is not None})
        self.state.paused, self.state.pause_mode = False, None
        self.state.prefix_cache_from = current
        self.state.serving_from = {str(r): d for r, d in digests.items() if d is not None}
        return violations

    def flush_cache(self) -> None:
        self.state.prefix_cache_from = None

    @staticmethod
    def _tags(tags: list[str] | None) -> list[str]:
        tags = list(tags or MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise Refused(f"unknown memory tags {unknown}; SGLang knows {list(MEMORY_TAGS)}")
        return tags

    def release_memory(self, tags: list[str] | None) -> list[str]:
        tags = self._tags(tags)
        if not self.state.paused:
            raise Refused("loopback: release_memory_occupation needs an idle engine: call pause_generation first")
        self.state.released_tags = sorted(set(self.state.released_tags) | set(tags))
        if "kv_cache" in tags:  # SGLang flushes the cache when it releases the KV memory
            self.flush_cache()
        return tags

    def resume_memory(self, tags: list[str] | None) -> list[str]:
        tags = self._tags(tags)
        missing = [t for t in tags if t not in self.state.released_tags]
        if missing:
            raise Refused(f"loopback: cannot resume {missing}: not released (released: {self.state.released_tags})")
        self.state.released_tags = sorted(set(self.state.released_tags) - set(tags))
        return tags

    def check_begin(self, selector: str) -> None:
        if selector not in SELECTORS:
            raise Refused(f"Invalid selector: {selector!r}. Expected one of {list(SELECTORS)}.")
        if self.state.session_open:
            raise Refused("a weight-update session is already open; call end_weight_update() first")

    def begin(self, selector: str) -> list[tuple[str, str]]:
        """Open the session (as SGLang: also while generation runs); returns the violations to record."""
        self.check_begin(selector)
        self.state.session_open, self.state.session_selector = True, selector
        if self.state.paused:
            return []
        return [
            (
                "weight_update_began_while_generating",
                "loopback: begin_weight_update while generation runs (SGLang does not check): writes into this "
                "session would land in a serving engine",
            )
        ]

    def check_end(self) -> None:
        if not self.state.session_open:
            raise Refused("no weight-update session is open; call begin_weight_update() first")

    def end(self) -> None:
        self.check_end()
        self.state.session_open, self.state.session_selector = False, None
        self.state.sessions_completed += 1

    def set_weight_version(self, version: str) -> None:
        self.state.weight_version = version
