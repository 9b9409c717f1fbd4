"""The loopback engine's control plane: the routes of SGLang's HTTP server that a weight sync uses.

Answers follow SGLang's (http_server.py of the reported `sglang_version`): bodies, status codes, old route
names, version-gated routes and fields, API-key auth through SGLang's own middleware. Calls that touch
weights go to the rank processes. Every call is recorded with its outcome (GET /loopback/events), except
/health and /loopback/* themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import requests
import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import BaseHTTPMiddleware

from verl_p2p.loopback.fault_injection import LoopbackFaults
from verl_p2p.loopback.features import Features
from verl_p2p.loopback.lifecycle import VIOLATION, Lifecycle, Refused
from verl_p2p.loopback.rank_worker import RankHandle, RankOpError, RankUnavailable

_UNRECORDED_PREFIXES = ("/health", "/loopback/")
OptionalBody = Annotated[dict | None, Body()]
RequiredBody = Annotated[dict, Body()]


@dataclass
class ControlContext:
    """What the control plane serves from: state, reported version, server args, the ranks."""

    lifecycle: Lifecycle
    features: Features
    server_args: dict[str, Any]
    bootstrap_url: str
    ranks: list[RankHandle]
    rank_timeout: float = 60.0
    faults: LoopbackFaults | None = None  # test/soak fault injection (fault_injection.py)

    def call_ranks(self, op: str, **kwargs) -> list[Any]:
        """`op` on every rank in rank order; RankUnavailable / RankOpError name the first rank that failed."""
        return [r.call(op, self.rank_timeout, **kwargs) for r in self.ranks]

    def weight_digests(self, timeout: float = 2.0) -> dict[int, str | None]:
        """Every rank's weight digest; None for a rank that does not answer within `timeout` (dead or frozen)."""
        digests: dict[int, str | None] = {}
        for r in self.ranks:
            try:
                digests[r.rank] = r.call("weights_digest", min(timeout, self.rank_timeout))
            except (RankUnavailable, RankOpError):
                digests[r.rank] = None
        return digests

    def dead_ranks(self) -> dict[int, str]:
        return {r.rank: r.death_reason() for r in self.ranks if not r.alive()}


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _hf_config(model_path: str) -> dict:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def create_app(ctx: ControlContext) -> FastAPI:
    """The FastAPI app of one loopback engine."""
    from sglang.srt.utils.auth import AuthLevel, add_api_key_middleware, auth_level

    app = FastAPI()
    lc, features = ctx.lifecycle, ctx.features
    hf_config = _hf_config(ctx.server_args["model_path"])
    admin = auth_level(AuthLevel.ADMIN_OPTIONAL)

    def finish(request: Request, body: dict | None, response: Response, message: str = "") -> Response:
        with lc.lock:
            lc.record(request.method, request.url.path, body, response.status_code, message)
        request.state.loopback_recorded = True
        return response

    def refused(request: Request, body: dict | None, e: Exception, status: int = 400) -> Response:
        return finish(request, body, _error(str(e), getattr(e, "status", status)), str(e))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # SGLang turns FastAPI's 422 into 400
        return JSONResponse(
            {"object": "error", "message": str(exc.errors()), "type": "Bad Request", "param": None, "code": 400},
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(
            {
                "object": "error",
                "message": exc.detail,
                "type": str(exc.status_code),
                "param": None,
                "code": exc.status_code,
            },
            status_code=exc.status_code,
        )

    # ---------------------------------------------------------------- read-only
    @app.get("/health")
    @app.get("/health_generate")
    def health() -> Response:
        return Response(status_code=503 if ctx.dead_ranks() else 200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    def server_info(request: Request) -> Response:
        with lc.lock:
            info = {
                **ctx.server_args,
                "weight_version": lc.state.weight_version,
                "internal_states": [{"loopback": True}],
                "version": features.version,
            }
        return finish(request, None, JSONResponse(info))

    @app.get("/model_info")
    @app.get("/get_model_info")
    def model_info(request: Request) -> Response:
        info = {
            "model_path": ctx.server_args["model_path"],
            "tokenizer_path": ctx.server_args.get("tokenizer_path"),
            "is_generation": True,
            "weight_version": lc.state.weight_version,
            "model_type": hf_config.get("model_type"),
            "architectures": hf_config.get("architectures"),
        }
        return finish(request, None, JSONResponse(info))

    @app.get("/weight_version")
    @app.get("/get_weight_version")
    def weight_version(request: Request) -> Response:
        if features.weight_version_route:
            return finish(request, None, JSONResponse({"weight_version": lc.state.weight_version}))
        detail = "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
        response = JSONResponse({"object": "error", "message": detail, "type": "404", "code": 404}, status_code=404)
        return finish(request, None, response, detail)

    @app.get("/remote_instance_transfer_engine_info")
    @app.get("/get_remote_instance_transfer_engine_info")
    @admin
    def transfer_engine_info(request: Request, rank: int | None = None) -> Response:
        if rank is None or rank < 0:
            return refused(request, None, ValueError("Missing or invalid rank parameter"))
        try:
            resp = requests.get(f"{ctx.bootstrap_url}/get_transfer_engine_info", params={"rank": rank}, timeout=5)
            if resp.status_code == 200:
                return finish(request, None, JSONResponse(resp.json()))
            reason = f"bootstrap answered {resp.status_code}: {resp.text}"
        except (requests.RequestException, ValueError) as e:
            reason = f"bootstrap unreachable: {e}"
        dead = ctx.dead_ranks()
        if rank in dead:
            reason = f"rank {rank} process is dead ({dead[rank]})"
        return refused(request, None, ValueError(f"Failed to get transfer engine info for rank {rank}: {reason}"))

    # ---------------------------------------------------------------- lifecycle
    @app.post("/pause_generation")
    @admin
    def pause_generation(request: Request, body: OptionalBody = None) -> Response:
        with lc.lock:
            try:
                violations = lc.pause(str((body or {}).get("mode", "abort")), ctx.weight_digests)
            except Refused as e:
                return refused(request, body, e)
            ok = JSONResponse({"message": "Generation paused successfully.", "status": "ok"})
            response = finish(request, body, ok, "paused")
            for name, message in violations:
                lc.record(VIOLATION, name, None, 200, message)
            return response

    @app.post("/continue_generation")
    @admin
    def continue_generation(request: Request, body: OptionalBody = None) -> Response:
        with lc.lock:  # as SGLang: no check at all; what it should have refused is recorded as a violation
            digests = ctx.weight_digests()
            violations = lc.resume_generation(digests)
            unread = [r for r, d in digests.items() if d is None]
            note = "continued" + (f" (rank(s) {unread} unreadable: cache freshness unknown)" if unread else "")
            ok = JSONResponse({"message": "Generation continued successfully.", "status": "ok"})
            response = finish(request, body, ok, note)
            for name, message in violations:
                lc.record(VIOLATION, name, None, 200, message)
            return response

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @admin
    def release_memory_occupation(request: Request, body: OptionalBody = None) -> Response:
        with lc.lock:
            try:
                tags = lc.release_memory((body or {}).get("tags"))
            except Refused as e:
                return refused(request, body, e)
            return finish(request, body, JSONResponse(None), f"released {tags}")

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    @admin
    def resume_memory_occupation(request: Request, body: OptionalBody = None) -> Response:
        with lc.lock:
            try:
                tags = lc.resume_memory((body or {}).get("tags"))
            except Refused as e:
                return refused(request, body, e)
            return finish(request, body, JSONResponse(None), f"resumed {tags}")

    def session_answer(request: Request, body: dict | None, success: bool, message: str) -> Response:
        response = JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)
        return finish(request, body, response, message)

    if features.weight_update_session:

        @app.post("/begin_weight_update")
        @admin
        def begin_weight_update(request: Request, body: OptionalBody = None) -> Response:
            with lc.lock:
                selector = str((body or {}).get("selector", "all"))
                try:
                    lc.check_begin(selector)
                    ctx.call_ranks("begin_update")  # every rank takes part (SGLang: a TP barrier); restores
                except (Refused, RankUnavailable, RankOpError) as e:
                    return session_answer(request, body, False, str(e))
                violations = lc.begin(selector)
                response = session_answer(request, body, True, "Success")
                for name, message in violations:
                    lc.record(VIOLATION, name, None, 200, message)
                return response

        @app.post("/end_weight_update")
        @admin
        def end_weight_update(request: Request, body: OptionalBody = None) -> Response:
            with lc.lock:
                try:
                    lc.check_end()
                    ran = ctx.call_ranks("post_load")  # the writes bypassed load_weights: post-load runs here
                except (Refused, RankUnavailable, RankOpError) as e:
                    return session_answer(request, body, False, str(e))
                lc.end()
                return session_answer(request, body, True, "Success" + (" (post_load_weights ran)" if any(ran) else ""))

    @app.post("/update_weight_version")
    @admin
    def update_weight_version(request: Request, body: RequiredBody) -> Response:
        if not isinstance(body.get("new_version"), str):
            return refused(request, body, ValueError("new_version (a string) is required"))
        with lc.lock:
            lc.set_weight_version(body["new_version"])
            aborted = bool(body.get("abort_all_requests", True))
            answer = {
                "success": True,
                "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"],
            }
            note = answer["message"] + (" (all requests aborted)" if aborted else "")
            return finish(request, body, JSONResponse(answer), note)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @admin
    def flush_cache(request: Request, timeout: float = 0.0) -> Response:
        # no requests ever run here, so the cache is always idle and the flush always succeeds (SGLang answers
        # 400 while requests run or wait: fault injection imitates that)
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        with lc.lock:
            lc.flush_cache()
            return finish(request, None, PlainTextResponse(text), "flushed")

    # ---------------------------------------------------------------- weights checker
    def weights_checker(request: Request, body: dict | None) -> Response:
        if body is None and not features.checker_skip_tensor_list:
            return refused(request, body, ValueError("body with 'action' is required"))
        body = body or {}
        action = body.get("action", "checksum" if features.checker_skip_tensor_list else None)
        if not isinstance(action, str):
            return refused(request, body, ValueError("'action' (a string) is required"))
        skip = list(body.get("skip_tensor_list") or []) if features.checker_skip_tensor_list else []
        with lc.lock:
            try:
                results = ctx.call_ranks(
                    "check",
                    action=action,
                    skip_tensor_list=skip,
                    drop_snapshot_after_compare=features.compare_drops_snapshot,
                )
            except (RankUnavailable, RankOpError) as e:
                return finish(request, body, JSONResponse({"success": False, "message": str(e)}, 400), str(e))
            success = all(r["success"] for r in results)
            if success:
                message = results[0]["message"]
            else:
                message = " | ".join(f"rank {i}: {r['message']}" for i, r in enumerate(results) if not r["success"])
            answer: dict[str, Any] = {"success": success, "message": message}
            payloads = [r["payload"] for r in results if r["payload"] is not None]
            if payloads:
                if not features.checksum_per_gpu:
                    payloads = [{k: v for k, v in p.items() if k != "per_gpu_checksum"} for p in payloads]
                else:
                    h = hashlib.sha256()
                    for p in payloads:
                        h.update(p["per_gpu_checksum"].encode())
                    answer["per_engine_checksum"] = h.hexdigest()
                if features.checksum_roles_list:  # one entry per runner role; the loopback runs the target only
                    payloads = [
                        {**p, "parallelism_info": [{"role": "target", **p["parallelism_info"]}]} for p in payloads
                    ]
                answer["ranks"] = payloads
            return finish(request, body, JSONResponse(answer, status_code=200 if success else 400), message)

    if features.checker_skip_tensor_list:

        @app.api_route("/weights_checker", methods=["GET", "POST"])
        @admin
        def weights_checker_route(request: Request, body: OptionalBody = None) -> Response:
            return weights_checker(request, body)

    else:

        @app.post("/weights_checker")
        @admin
        def weights_checker_route_old(request: Request, body: RequiredBody) -> Response:
            return weights_checker(request, body)

    # ---------------------------------------------------------------- loopback only
    @app.get("/loopback/events")
    def events(since: int = 0) -> Response:
        return JSONResponse({"events": [asdict(e) for e in lc.events(since)]})

    async def inject_and_record(request: Request, call_next):
        path = request.url.path
        fault = ctx.faults.take(path) if ctx.faults is not None and not path.startswith("/loopback/") else None
        if fault is not None:
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.status is not None:
                try:
                    body = json.loads(await request.body() or b"null")
                except ValueError:
                    body = None
                lc.record(request.method, path, body, fault.status, f"injected fault: {fault.message}")
                return JSONResponse(fault.body(), status_code=fault.status)
        response = await call_next(request)
        if not getattr(request.state, "loopback_recorded", False) and not path.startswith(_UNRECORDED_PREFIXES):
            lc.record(request.method, path, None, response.status_code, "not handled (auth, route or body)")
        return response

    add_api_key_middleware(app, api_key=ctx.server_args.get("api_key"), admin_api_key=None)
    app.add_middleware(BaseHTTPMiddleware, dispatch=inject_and_record)  # outermost: also sees 401s
    return app


class ThreadedServer:
    """A uvicorn server for `app` on host:port in a daemon thread of this process."""

    def __init__(self, app: FastAPI, host: str, port: int):
        self.host, self.port = host, port
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True, name=f"loopback-http-{port}")

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"control server could not start on {self.host}:{self.port} (port in use?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"control server on {self.host}:{self.port} did not start in {timeout} s")
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
