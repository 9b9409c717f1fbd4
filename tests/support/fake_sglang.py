"""FakeSGLang: a STAND-IN for one SGLang engine's control plane and bootstrap server (tests only).

Real HTTP on 127.0.0.1 (stdlib ThreadingHTTPServer, keep-alive), SGLang's routes and answer shapes
(docs/protocol.md sections 2-3), and a
lifecycle state machine that refuses out-of-order calls with 400 the way a strict SGLang would. What SGLang
itself allows it allows too, and records in `violations`: continue_generation inside an open weight-update
session, with the KV cache released, or with a prefix cache holding KV from weights written since the last
/flush_cache (or KV release). It holds no model: `write()` stands for the trainer's push, and `compare` passes
only when a push landed after `reset_tensors`. verl_p2p/loopback (real model, real Mooncake) covers the same
end to end.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

NOT_FOUND = (404, {"detail": "Not Found"})


@dataclass
class Injected:
    """A canned failure for one route: answer `status` + `body` for the next `times` calls (None: always)."""

    status: int
    body: Any
    times: int | None = None


class _JSON(bytes):
    """An answer body already encoded as JSON."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128  # socketserver default 5 drops SYNs under parallel connects (1 s retry)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # like uvicorn; else headers and body wait out delayed ACKs (40 ms)

    def log_message(self, *args):  # keep test output quiet
        pass

    def _serve(self, method: str) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        status, payload = self.server.owner._dispatch(self.server.kind, method, parts.path, query, body, self.headers)
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        ctype = "text/plain" if isinstance(payload, bytes) and not isinstance(payload, _JSON) else "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")


class FakeSGLang:
    """One engine: `url` (control plane) and `bootstrap_url`; `calls` is the ordered list of routes served."""

    def __init__(
        self,
        *,
        tp_size: int = 1,
        version: str = "0.5.23",
        sessions: bool = True,
        old_routes_only: bool = False,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        params_per_rank: int = 4,
        server_args: Mapping[str, Any] | None = None,
        bootstrap: bool = True,
    ):
        self.tp_size = tp_size
        self.version = version
        self.sessions = sessions
        self.old_routes_only = old_routes_only
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self._auth_levels = sglang_auth_levels(version) if admin_api_key else None
        self.server_args = {"tp_size": tp_size, "pp_size": 1, "ep_size": 1, "dp_size": 1, **(server_args or {})}
        self.lock = threading.Lock()
        self.calls: list[str] = []
        self.bootstrap_calls: list[str] = []
        self.journal: list[str] | None = None  # a list shared with other recorders: every call, in arrival order
        self.bodies: dict[str, list[Any]] = {}
        self.headers: list[dict[str, str]] = []
        self.injected: dict[str, Injected] = {}
        self.delays: dict[str, float] = {}
        self.rank_info = {
            r: [
                f"127.0.0.1:{17000 + r}",
                {
                    f"model.layers.{i}.mlp.weight": [0x7F0000000000 + (r << 32) + i * 4096, 1024, 2]
                    for i in range(params_per_rank)
                },
            ]
            for r in range(tp_size)
        }
        # lifecycle state
        self.paused = False
        self.kv_released = False
        self.session_open = False
        self.weight_version = "default"
        self.pushes = 0
        self.cache_stale = False  # the prefix cache holds KV computed with weights written since its last flush
        self.violations: list[str] = []  # what SGLang allows but p2p must never do, in order
        self.checker = "none"  # none -> snapshot -> reset -> (compare)
        self.pushed_since_reset = False
        self.compare_error: str | None = None
        self.compare_error_times: int | None = None  # compares that fail with compare_error (None: every one)
        self._encoded: dict[int, tuple[str, bytes]] = {}
        self._stop = threading.Event()
        self._http = self._start("control")
        self._bootstrap = self._start("bootstrap") if bootstrap else None

    # ---- plumbing ----------------------------------------------------------------------------------------

    def _start(self, kind: str) -> _Server:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.owner, server.kind = self, kind
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def bootstrap_url(self) -> str | None:
        return f"http://127.0.0.1:{self._bootstrap.server_address[1]}" if self._bootstrap else None

    def stop(self) -> None:
        self._stop.set()
        for server in (self._http, self._bootstrap):
            if server is not None:
                server.shutdown()
                server.server_close()

    def __enter__(self) -> FakeSGLang:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- test controls -----------------------------------------------------------------------------------

    def fail(self, route: str, status: int, body: Any, times: int | None = None) -> None:
        self.injected[route] = Injected(status, body, times)

    def delay(self, route: str, seconds: float) -> None:
        self.delays[route] = seconds

    def restart(self, session_ids: Mapping[int, str]) -> None:
        """The server was killed and started again at the same address: generating, KV allocated, no session,
        its weights from the checkpoint, new transfer-engine sessions (`session_ids`: rank -> new id)."""
        with self.lock:
            self.paused = self.kv_released = self.session_open = self.cache_stale = False
            self.weight_version = "default"
            self.checker = "none"
            for rank, session_id in session_ids.items():
                self.rank_info[rank][0] = session_id

    def set_session_id(self, rank: int, session_id: str) -> None:
        with self.lock:
            self.rank_info[rank][0] = session_id

    def write(self) -> None:
        """The trainer's push into this engine's weights: legal only while paused and (if any) in a session."""
        with self.lock:
            self._write()

    def _write(self) -> None:  # self.lock held
        if not self.paused:
            raise AssertionError(f"{self.url}: push while generating")
        if self.sessions and not self.session_open:
            raise AssertionError(f"{self.url}: push outside a weight-update session")
        self.calls.append("push")
        if self.journal is not None:
            self.journal.append("push")
        self.pushes += 1
        self.pushed_since_reset = True
        self.cache_stale = True

    def lifecycle_calls(self) -> list[str]:
        """The calls that change state, in order (reads such as server_info and rank info left out)."""
        reads = {"server_info", "get_server_info", "health", "model_info", "weight_version", "get_weight_version"}
        reads.add("stand_in_push")  # not a route of SGLang's: the push it reports is recorded as "push"
        return [c for c in self.calls if c not in reads and "transfer_engine_info" not in c]

    # ---- routes ------------------------------------------------------------------------------------------

    def _dispatch(self, kind, method, path, query, body, headers) -> tuple[int, Any]:
        route = path.strip("/")
        with self.lock:
            (self.calls if kind == "control" else self.bootstrap_calls).append(route)
            if self.journal is not None:
                self.journal.append(route)
            self.bodies.setdefault(route, []).append(body)
            self.headers.append(dict(headers))
        delay = self.delays.get(route)
        if delay:
            self._stop.wait(delay)
        if kind == "bootstrap":
            return self._bootstrap_route(route, query)
        if self._auth_levels is not None:  # SGLang's own decision, per route level of its release
            refused = _sglang_refusal(self, method, path, headers.get("Authorization"))
            if refused is not None:
                return refused
        elif self.api_key and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {"error": "Unauthorized"}
        injected = self.injected.get(route)
        if injected is not None and injected.times != 0:
            if injected.times is not None:
                injected.times -= 1
            return injected.status, injected.body
        if route.endswith("remote_instance_transfer_engine_info"):  # the control plane's proxy route
            if self.old_routes_only and not route.startswith("get_"):
                return NOT_FOUND
            return self._rank(query, missing=400)
        handler = getattr(self, "_r_" + route, None)
        if handler is None:
            return NOT_FOUND
        with self.lock:
            return handler(method, query, body or {})

    def _bootstrap_route(self, route, query) -> tuple[int, Any]:
        if route == "health":
            return 200, b"OK"
        if route == "get_transfer_engine_info":
            return self._rank(query, missing=404)
        return NOT_FOUND

    def _rank(self, query, missing: int) -> tuple[int, Any]:
        rank = int(query.get("rank", -1))
        if rank < 0:
            return 400, {"detail": "Invalid rank parameter"}
        with self.lock:
            info = self.rank_info.get(rank)
            if info is None:
                return missing, {"detail": f"No transfer engine info for rank {rank}"}
            cached = self._encoded.get(rank)
            if cached is None or cached[0] != info[0]:  # encode once per session id: a cheap server
                body = {"rank": rank, "remote_instance_transfer_engine_info": info}
                cached = self._encoded[rank] = (info[0], _JSON(json.dumps(body).encode()))
            return 200, cached[1]

    @staticmethod
    def _refuse(message: str) -> tuple[int, Any]:
        return 400, {"success": False, "message": f"out of order: {message}"}

    def _new_route(self, answer):
        return NOT_FOUND if self.old_routes_only else answer

    def _r_health(self, method, query, body):
        return 200, b""

    def _server_info(self):
        return 200, {**self.server_args, "version": self.version, "weight_version": self.weight_version}

    def _r_server_info(self, method, query, body):
        return self._new_route(self._server_info())

    def _r_get_server_info(self, method, query, body):
        return self._server_info()

    def _r_model_info(self, method, query, body):
        return 200, {"model_path": "stand-in", "weight_version": self.weight_version}

    def _r_weight_version(self, method, query, body):
        return self._new_route((200, {"weight_version": self.weight_version}))

    def _r_get_weight_version(self, method, query, body):
        return 200, {"weight_version": self.weight_version}

    def _r_pause_generation(self, method, query, body):
        if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
            return 400, {"error": {"message": f"invalid mode {body.get('mode')!r}"}}
        self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _r_continue_generation(self, method, query, body):
        # SGLang checks nothing here: record what must never happen instead of refusing it
        if self.kv_released:
            self.violations.append("resumed_with_kv_cache_released")
        if self.session_open:
            self.violations.append("resumed_inside_weight_update_session")
        if self.cache_stale:
            self.violations.append("served_stale_prefix_cache")
        self.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _r_release_memory_occupation(self, method, query, body):
        if not self.paused:
            return 400, {"error": {"message": "release_memory_occupation should be called only when server is idle."}}
        if self.kv_released:
            return self._refuse("KV cache already released")
        self.kv_released = True
        self.cache_stale = False  # SGLang flushes the cache when it releases the KV memory
        return 200, None

    def _r_resume_memory_occupation(self, method, query, body):
        if not self.kv_released:
            return self._refuse("KV cache was not released")
        self.kv_released = False
        return 200, None

    def _r_begin_weight_update(self, method, query, body):
        if not self.sessions:
            return NOT_FOUND
        if not self.paused:
            return self._refuse("begin_weight_update while generating (pause first)")
        if self.session_open:
            return 400, {"success": False, "message": "a weight-update session is already open"}
        self.session_open = True
        return 200, {"success": True, "message": "Success"}

    def _r_end_weight_update(self, method, query, body):
        if not self.sessions:
            return NOT_FOUND
        if not self.session_open:
            return 400, {"success": False, "message": "no weight-update session is open"}
        self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def _r_update_weight_version(self, method, query, body):
        if body.get("abort_all_requests", True):
            return self._refuse("abort_all_requests must be false during a weight sync")
        if not self.paused or (self.sessions and not self.session_open):
            return self._refuse("update_weight_version outside the sync (after end or before begin)")
        self.weight_version = body["new_version"]
        return 200, {"success": True, "new_version": self.weight_version, "message": "ok"}

    def _r_flush_cache(self, method, query, body):
        self.cache_stale = False
        return 200, b"Cache flushed."

    def _r_stand_in_push(self, method, query, body):
        """Not an SGLang route: a trainer-rank stand-in in another process says its push landed here
        (tests/support/flaky_ranks.py), as `write()` says it in-process; an illegal push is a violation."""
        try:
            self._write()
        except AssertionError as exc:
            self.violations.append(str(exc))
            return 400, {"success": False, "message": str(exc)}
        return 200, {"success": True}

    def _r_weights_checker(self, method, query, body):
        action = body.get("action")
        if action == "snapshot":
            self.checker = "snapshot"
        elif action == "reset_tensors":
            if self.checker != "snapshot":
                return 400, {"success": False, "message": "reset_tensors before snapshot"}
            self.checker, self.pushed_since_reset = "reset", False
        elif action == "compare":
            if self.checker != "reset":
                return 400, {"success": False, "message": "compare without snapshot + reset"}
            if self.compare_error or not self.pushed_since_reset:
                message = self.compare_error or "model.layers.0.mlp.weight: values differ from the snapshot"
                if self.compare_error and self.compare_error_times is not None:
                    self.compare_error_times -= 1
                    if self.compare_error_times <= 0:
                        self.compare_error = self.compare_error_times = None
                return 400, {"success": False, "message": message}
            self.checker = "compared"
        else:
            return 400, {"success": False, "message": f"unknown action {action!r}"}
        return 200, {"success": True, "message": f"{action} ok"}


def free_port() -> int:
    """A port nothing listens on (bound then closed): for connection-refused tests."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = ["FakeSGLang", "Injected", "free_port"]


# ---- SGLang's API-key rules (with admin_api_key) --------------------------------------------------------------


def sglang_auth_levels(version: str) -> dict[str, str]:
    """Route -> SGLang auth level ("normal", "admin_optional", "admin_force") as SGLang `version`'s http_server.py
    declares them (`@auth_level(AuthLevel.X)` under the route's decorator; none: normal). Read from that release's
    sources under .venv (make setup installs 0.5.21 / 0.5.23), else from the installed SGLang."""
    import ast
    import importlib.util
    from pathlib import Path

    release = Path(__file__).resolve().parents[2] / ".venv" / f"sglang-{version}" / "sglang"
    if not release.is_dir():
        release = Path(importlib.util.find_spec("sglang").origin).parent
    tree = ast.parse((release / "srt" / "entrypoints" / "http_server.py").read_text())
    levels = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        level, routes = "normal", []
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            name = ast.unparse(deco.func)
            if name == "auth_level":
                level = ast.unparse(deco.args[0]).rsplit(".", 1)[-1].lower()
            elif name.startswith("app.") and deco.args and isinstance(deco.args[0], ast.Constant):
                routes.append(deco.args[0].value)
        levels.update(dict.fromkeys(routes, level))
    return levels


def _sglang_refusal(fake: FakeSGLang, method: str, path: str, authorization: str | None) -> tuple[int, Any] | None:
    """SGLang's `decide_request_auth` (srt/utils/auth.py, imported: it needs no torch) for this route's level."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    level = AuthLevel(fake._auth_levels.get(path, "normal"))
    decision = decide_request_auth(
        method=method,
        path=path,
        authorization_header=authorization,
        api_key=fake.api_key,
        admin_api_key=fake.admin_api_key,
        auth_level=level,
    )
    if decision.allowed:
        return None
    return decision.error_status_code, {"error": "Unauthorized" if decision.error_status_code == 401 else "Forbidden"}
