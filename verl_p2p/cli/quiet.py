"""Quiet command runs: a command's own lines on the terminal, everything else in a log file.

The demo, the bench and the plan load SGLang, Megatron and Mooncake, which print import warnings, log lines,
progress bars and even caught import tracebacks (Megatron's optional FP8 import), from this process and from
the child processes it starts. `run_quietly` points file descriptors 1 and 2 at a log file, so C-level output
and every child process (which inherits them) land there, and makes `sys.stdout` and `sys.stderr` routers:
what code of this package prints goes to the original stream, what any other module prints goes to the log.
It says where the log is and turns an exception into one line naming it and the log. With `verbose` nothing is
redirected and an exception propagates with its traceback. A caller that already replaced `sys.stdout` and
`sys.stderr` (a test capturing output) keeps its descriptors: only those objects are routed, and put back after.

The descriptors stay on the log until the process exits, so shutdown noise (atexit handlers, resource
trackers) lands there as well: use it around a command's `main`, not inside a library call.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quietly(command: str, verbose: bool, main: Callable[[], int], notice_on_stderr: bool = False) -> int:
    """Run `main()` (which prints its own lines to `sys.stdout`/`sys.stderr`) with third-party output sent to a
    log file. `notice_on_stderr`: say where the log is on stderr (a command whose stdout is data, e.g. JSON)."""
    if verbose:
        return main()
    log_path, restore = _redirect_to_log(command)
    notice = f"[{command}] third-party output (warnings, logs, child processes) goes to {log_path}; -v shows it here"
    print(notice, file=sys.stderr if notice_on_stderr else sys.stdout, flush=True)
    try:
        return main()
    except KeyboardInterrupt:
        print(f"[{command}] interrupted (log: {log_path})")
        return 130
    except Exception as exc:  # noqa: BLE001 - one readable line here, the traceback in the log
        traceback.print_exc()  # sys.stderr: the log
        sys.stderr.flush()
        print(f"[{command}] FAILED: {type(exc).__name__}: {exc} (traceback in {log_path})")
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        restore()


class _Router(io.TextIOBase):
    """`sys.stdout` or `sys.stderr` of a quiet run: writes made by this package's code go to `console`, all
    others to `log`."""

    def __init__(self, console: TextIO, log: TextIO):
        self.console, self.log = console, log

    @property
    def encoding(self) -> str:
        return "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return (self.console if _printed_by_us(sys._getframe(1)) else self.log).write(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def fileno(self) -> int:
        return self.log.fileno()  # handed to a child process, it writes into the log

    def isatty(self) -> bool:
        return False


def _printed_by_us(frame) -> bool:
    """Whether the code that printed is part of this package: the first frame that is not a wrapper of `write`
    (wandb wraps `sys.stdout.write` in place) or of `print` (Ray's driver replaces `builtins.print` with its
    tqdm `safe_print` once a worker's log line reaches it, for the rest of the process)."""
    while frame is not None and _is_output_wrapper(frame.f_code.co_name):
        frame = frame.f_back
    caller = frame.f_globals.get("__file__") if frame is not None else None
    return bool(caller) and os.path.abspath(caller).startswith(_PACKAGE_DIR + os.sep)


def _is_output_wrapper(function_name: str) -> bool:
    return "write" in function_name or function_name == "print" or function_name.endswith("_print")


def _redirect_to_log(command: str) -> tuple[str, Callable[[], None]]:
    """Send third-party output to a new log file; returns its path and what undoes the redirection.

    A process whose streams are its own: fds 1 and 2 -> the log (C-level output and child processes too), for
    good (nothing to undo). A caller that already replaced `sys.stdout`/`sys.stderr` (a test capturing output,
    an embedding program): only those objects are routed, and restored afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd, path = tempfile.mkstemp(prefix=f"verl-p2p-{command}-", suffix=".log")
    if sys.stdout is not sys.__stdout__ or sys.stderr is not sys.__stderr__:
        saved = sys.stdout, sys.stderr
        log = os.fdopen(fd, "w", buffering=1, encoding="utf-8", errors="replace")
        sys.stdout, sys.stderr = _Router(saved[0], log), _Router(saved[1], log)

        def restore() -> None:
            sys.stdout, sys.stderr = saved
            log.close()

        return path, restore
    console = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    console_err = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = _Router(console, sys.stdout)  # the old objects write to fds 1 and 2: the log now
    sys.stderr = _Router(console_err, sys.stderr)
    return path, lambda: None


class Progress:
    """Elapsed-time lines while something slow starts: `done(what)` at once, and every `every` seconds a line
    naming what is still `pending` (a list the caller keeps up to date)."""

    def __init__(self, prefix: str, every: float = 10.0):
        self.prefix = prefix
        self.every = every
        self.pending: list[str] = []
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def say(self, text: str) -> None:
        with self._lock:
            print(f"{self.prefix} {self.elapsed:5.1f} s  {text}", flush=True)

    def done(self, what: str) -> None:
        if what in self.pending:
            self.pending.remove(what)
        self.say(f"{what}: ready")

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            if self.pending:
                self.say("waiting for " + ", ".join(self.pending))


@contextmanager
def progress(prefix: str, pending: list[str], every: float = 10.0) -> Iterator[Progress]:
    """A `Progress` whose ticker runs while inside; `pending` names what is being waited for."""
    tracker = Progress(prefix, every)
    tracker.pending = list(pending)
    ticker = threading.Thread(target=tracker._tick, daemon=True, name="verl-p2p-progress")
    ticker.start()
    try:
        yield tracker
    finally:
        tracker._stop.set()
        ticker.join()
