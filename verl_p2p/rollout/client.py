"""Async client of one SGLang server (control plane) and its engine-info bootstrap server.

The wire contract is docs/protocol.md sections 2-3. Calls use aiohttp on the running loop (keep-alive
connections, no thread hops, no blocking I/O on the loop). An aiohttp session is bound to the loop it was made
on, and verl drives the lifecycle from `asyncio.run` in some trainer modes (a fresh loop per call) and from a
long-lived loop in others, so a client keeps one session per running loop, made on first use and closed when
that loop shuts down its async generators (asyncio.run does) or by `close()`. Every failure raises
`RolloutCallError` naming the server, the route, the HTTP status and the server's own message.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import socket
import threading
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from verl_p2p.errors import RolloutHTTPError
from verl_p2p.planning.targets import RemoteRankInfo

logger = logging.getLogger(__name__)

# Keep-alive connections per server, per loop: rank-info reads fan out over every TP rank at once.
_PER_HOST = 64
# SGLang's uvicorn closes a keep-alive connection idle for 5 s (SGLANG_TIMEOUT_KEEP_ALIVE); a push takes longer
# than that, so the client drops idle connections first instead of sending the next step into a closing socket.
_KEEPALIVE_S = 3.0

_HINTS = {
    401: "send the server's keys: set engine_kwargs.sglang.api_key / admin_api_key as the server was started, or "
    "checkpoint_engine.engine_kwargs.p2p.api_key",
    403: "send the server's admin API key: set checkpoint_engine.engine_kwargs.p2p.api_key",
}
# The routes p2p calls that SGLang guards as ordinary ones (no `auth_level` in its http_server.py: only
# `api_key` opens them); every other control route it calls is ADMIN_OPTIONAL. Bootstrap-server routes take no key.
NORMAL_ROUTES = frozenset(
    {"/health", "/server_info", "/get_server_info", "/weight_version", "/get_weight_version", "/model_info"}
)


@dataclass(frozen=True)
class ServerKeys:
    """The bearer tokens an SGLang server was started with. SGLang (`srt/utils/auth.py`) opens its ordinary routes
    with `api_key` only, and its admin routes (pause, memory, weights, sessions, rank info) with `admin_api_key`
    when the server has one, else with `api_key`: a server started with both needs each on its own routes."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def for_route(self, route: str) -> str | None:
        if route in NORMAL_ROUTES:
            return self.api_key or self.admin_api_key  # with no api_key these routes are open: any token passes
        return self.admin_api_key or self.api_key


class RolloutCallError(RolloutHTTPError):
    """One failed call: `status` is None when no HTTP answer came (refused, timed out, reset)."""

    def __init__(self, server: str, method: str, route: str, status: int | None, message: str, hint: str = ""):
        self.server, self.method, self.route, self.status, self.message, self.hint = (
            server,
            method,
            route,
            status,
            message,
            hint,
        )
        where = f"{server} {method} {route}"
        what = f"HTTP {status}: {message}" if status is not None else message
        super().__init__(f"{where}: {what}" + (f" ({hint})" if hint else ""))


@dataclass(frozen=True)
class RankAnswer:
    """A rank's published info plus a digest of the raw answer: equal digests mean nothing changed."""

    digest: str
    info: RemoteRankInfo


@dataclass(frozen=True)
class Response:
    """One fully read HTTP answer; the fields and methods callers use are named as in `requests`."""

    status_code: int
    reason: str
    url: str
    content: bytes
    encoding: str = "utf-8"

    @property
    def text(self) -> str:
        return self.content.decode(self.encoding, errors="replace")

    def json(self) -> Any:
        """The body as JSON; raises ValueError (json.JSONDecodeError) when it is not."""
        return json.loads(self.content)


def normalize_url(address: str) -> str:
    """`host:port` (what verl's `server_address` holds) or a full URL -> `http://host:port` without a slash."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


def message_of(response: Response) -> str:
    """The server's own error text: JSON `message`/`error`/`detail` (SGLang nests them), else the body text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason or "(empty body)"
    return _message_in(body) or json.dumps(body)[:500]


def _message_in(body: Any) -> str | None:
    if isinstance(body, str):
        return body
    if isinstance(body, list):  # FastAPI validation errors: detail = [{"msg": ..., "loc": ...}, ...]
        parts = [_message_in(item) for item in body]
        return "; ".join(p for p in parts if p) or None
    if isinstance(body, Mapping):
        for key in ("message", "error", "detail", "msg"):
            if key in body and body[key]:
                found = _message_in(body[key])
                if found:
                    return found
    return None


class SGLangClient:
    """One SGLang server (`url`, node 0's HTTP server) and optionally its bootstrap server (`bootstrap_url`).

    Rank info comes from the bootstrap server when given (one hop, no proxy timeout); when it cannot be
    reached (SGLang binds it to `server_args.host`, by default 127.0.0.1) the control plane's proxy route is
    used instead, with one warning.
    """

    def __init__(
        self,
        url: str,
        *,
        bootstrap_url: str | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout: float = 60.0,
    ):
        self.url = normalize_url(url)
        self.bootstrap_url = normalize_url(bootstrap_url) if bootstrap_url else None
        self.timeout = timeout
        self.keys = ServerKeys(api_key, admin_api_key)
        # one aiohttp session per running loop, with the async generator that closes it at loop shutdown
        self._sessions: dict[asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, AsyncGenerator]] = {}
        self._lock = threading.Lock()
        self._closing: set[asyncio.Task] = set()  # close() tasks scheduled on a running loop, kept until done
        self.sessions_supported: bool | None = None  # None until begin/end was called once
        self._bootstrap_reachable = True
        self._warned: set[str] = set()
        self._routes: dict[tuple[str, ...], int] = {}  # route names -> index of the one this server answers

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r}, bootstrap_url={self.bootstrap_url!r})"

    def close(self) -> None:
        """Close every loop's session. Callable from sync code, also on a loop's own thread while it runs; a
        later call opens a new session."""
        with self._lock:
            entries = list(self._sessions.items())
            self._sessions.clear()
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for loop, (_, closer) in entries:
            if loop.is_closed():
                _finish(closer)
            elif loop is current:  # sync code on the running loop: closed once the loop gets control back
                task = loop.create_task(_aclose(closer))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            elif loop.is_running():  # another thread's loop: handed over, never waited for
                asyncio.run_coroutine_threadsafe(_aclose(closer), loop)
            elif current is None:  # an idle loop (run_until_complete between calls)
                loop.run_until_complete(_aclose(closer))
            # else an idle loop while another runs on this thread: its shutdown_asyncgens() closes the session

    async def _session_here(self) -> aiohttp.ClientSession:
        """This loop's session, made on first use. Its closer is an async generator registered with the loop,
        so the loop's shutdown_asyncgens() (asyncio.run calls it) closes the session before the loop closes."""
        loop = asyncio.get_running_loop()
        entry = self._sessions.get(loop)
        if entry is not None and not entry[0].closed:
            return entry[0]
        with self._lock:
            stale = [key for key in self._sessions if key is loop or key.is_closed()]
            dropped = [self._sessions.pop(key)[1] for key in stale]
            # trust_env stays off: unlike requests, no proxy from HTTP(S)_PROXY and no ~/.netrc (its lookup
            # would cost a thread hop per call); control-plane calls always go straight to the server
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=_PER_HOST, keepalive_timeout=_KEEPALIVE_S)
            session = aiohttp.ClientSession(connector=connector)
            closer = _closer(session, loop)
            self._sessions[loop] = (session, closer)
        for old in dropped:  # sessions of closed loops (nothing left to do on them) or closed ones of this loop
            _finish(old)
        await closer.__anext__()  # runs to its `yield` at once; the loop's firstiter hook registers it
        return session

    # ---- transport -------------------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        route: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        base: str | None = None,
    ) -> Response:
        """One call on the running loop; returns the 2xx response, body read, or raises RolloutCallError.
        `timeout` bounds connecting and each wait for data, as `requests` does."""
        base = base or self.url
        timeout = self.timeout if timeout is None else timeout
        shown = route + ("?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else "")
        key = self.keys.for_route(route) if base == self.url else None  # the bootstrap server takes none
        headers = {"Authorization": f"Bearer {key}"} if key else None
        session = await self._session_here()
        limits = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        try:
            for attempt in (1, 2):
                try:
                    async with session.request(
                        method, base + route, json=body, params=params, headers=headers, timeout=limits
                    ) as answer:
                        content = await answer.read()
                        response = Response(
                            answer.status, answer.reason or "", str(answer.url), content, answer.charset or "utf-8"
                        )
                    break
                except aiohttp.ServerDisconnectedError:
                    # a pooled connection the server had already closed (its keep-alive ran out while this loop
                    # was busy): the request never reached it, so send it once more on a new connection
                    if attempt == 2:
                        raise
        except aiohttp.ConnectionTimeoutError as exc:
            raise RolloutCallError(
                base, method, shown, None, f"no connection within {timeout:g} s", "is the server up?"
            ) from exc
        except TimeoutError as exc:  # aiohttp.SocketTimeoutError and any other wait for data
            raise RolloutCallError(
                base, method, shown, None, f"no answer within {timeout:g} s", "raise engine_kwargs.p2p.http_timeout"
            ) from exc
        except aiohttp.ClientConnectionError as exc:  # refused, unresolvable, reset, disconnected
            raise RolloutCallError(
                base, method, shown, None, f"cannot connect ({_reason(exc)})", "is the server running there?"
            ) from exc
        except aiohttp.ClientError as exc:
            raise RolloutCallError(base, method, shown, None, f"request failed: {exc}") from exc
        if response.status_code >= 400:
            raise RolloutCallError(
                base, method, shown, response.status_code, message_of(response), _HINTS.get(response.status_code, "")
            )
        return response

    async def _json(self, method: str, route: str, **kwargs) -> Any:
        response = await self.request(method, route, **kwargs)
        answer = _json_or_text(response)
        if isinstance(answer, Mapping) and answer.get("success") is False:  # an error dressed as 200
            raise RolloutCallError(
                kwargs.get("base") or self.url, method, route, response.status_code, _message_in(answer) or "failed"
            )
        return answer

    async def _first_route(self, method: str, routes: Sequence[str], **kwargs) -> tuple[str, Response]:
        """Try each route name in turn while the server answers 404 (renamed or removed endpoints); the one
        that answered is tried first next time."""
        key = tuple(routes)
        start = self._routes.get(key, 0)
        for i in range(start, len(routes)):
            try:
                response = await self.request(method, routes[i], **kwargs)
            except RolloutCallError as exc:
                if exc.status != 404 or i == len(routes) - 1:
                    raise
                continue
            self._routes[key] = i
            return routes[i], response
        raise AssertionError("unreachable")

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(text)

    # ---- control plane ---------------------------------------------------------------------------------

    async def health(self, timeout: float | None = None) -> None:
        await self.request("GET", "/health", timeout=timeout)

    async def server_info(self, timeout: float | None = None) -> dict[str, Any]:
        """Every ServerArgs field + scheduler info + `version` (`/server_info`, older `/get_server_info`)."""
        _, response = await self._first_route("GET", ("/server_info", "/get_server_info"), timeout=timeout)
        return response.json()

    async def weight_version(self, timeout: float | None = None) -> str | None:
        """Current weight version: `/weight_version`, `/get_weight_version`, else `/model_info` (0.5.12+)."""
        route, response = await self._first_route(
            "GET", ("/weight_version", "/get_weight_version", "/model_info"), timeout=timeout
        )
        answer = _json_or_text(response)
        if isinstance(answer, Mapping):
            value = answer.get("weight_version", answer.get("version"))
            return None if value is None else str(value)
        return str(answer)

    async def pause_generation(self, mode: str = "abort", timeout: float | None = None) -> Any:
        return await self._json("POST", "/pause_generation", body={"mode": mode}, timeout=timeout)

    async def continue_generation(self, timeout: float | None = None) -> Any:
        return await self._json("POST", "/continue_generation", body={}, timeout=timeout)

    async def release_memory_occupation(self, tags: Sequence[str] = ("kv_cache",), timeout: float | None = None):
        return await self._json("POST", "/release_memory_occupation", body={"tags": list(tags)}, timeout=timeout)

    async def resume_memory_occupation(self, tags: Sequence[str] = ("kv_cache",), timeout: float | None = None):
        return await self._json("POST", "/resume_memory_occupation", body={"tags": list(tags)}, timeout=timeout)

    async def flush_cache(self, timeout: float | None = None) -> Any:
        return await self._json("POST", "/flush_cache", timeout=timeout)

    async def begin_weight_update(self, selector: str = "all", timeout: float | None = None) -> bool:
        """Open a weight-update session; False when the server predates sessions (404, SGLang < 0.5.21)."""
        return await self._session_call("/begin_weight_update", {"selector": selector}, timeout)

    async def end_weight_update(self, timeout: float | None = None) -> bool:
        """Close the session (runs quant finalisation and post_load_weights); False when unsupported."""
        return await self._session_call("/end_weight_update", {}, timeout)

    async def _session_call(self, route: str, body: dict, timeout: float | None) -> bool:
        if self.sessions_supported is False:
            return False
        try:
            await self._json("POST", route, body=body, timeout=timeout)
        except RolloutCallError as exc:
            if exc.status != 404:
                raise
            self.sessions_supported = False
            self._warn_once(
                "sessions",
                f"SGLang at {self.url} has no {route} (it predates weight-update sessions, added in 0.5.21): "
                "continuing without sessions; post-load processing (quantization finalisation, "
                "post_load_weights) will NOT run after weight updates on this server",
            )
            return False
        self.sessions_supported = True
        return True

    async def update_weight_version(
        self, version: str, abort_all_requests: bool = False, timeout: float | None = None
    ) -> Any:
        """Set the weight version; the server's default aborts every request, so False is always sent."""
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return await self._json("POST", "/update_weight_version", body=body, timeout=timeout)

    async def weights_checker(
        self,
        action: str,
        *,
        allow_quant_error: bool | None = None,
        skip_tensor_list: Sequence[str] | None = None,
        selector: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """`snapshot` / `reset_tensors` / `compare` / `checksum`; optional fields are sent only when given
        (the caller gates them by server version)."""
        body: dict[str, Any] = {"action": action}
        if allow_quant_error is not None:
            body["allow_quant_error"] = allow_quant_error
        if skip_tensor_list is not None:
            body["skip_tensor_list"] = list(skip_tensor_list)
        if selector is not None:
            body["selector"] = selector
        return await self._json("POST", "/weights_checker", body=body, timeout=timeout)

    # ---- rank info ---------------------------------------------------------------------------------------

    async def bootstrap_health(self, timeout: float | None = None) -> str:
        if not self.bootstrap_url:
            raise ValueError(f"{self.url}: no bootstrap_url configured")
        response = await self.request("GET", "/health", base=self.bootstrap_url, timeout=timeout)
        return response.text

    async def rank_answer(self, rank: int, previous: RankAnswer | None = None, timeout: float | None = None):
        """Rank `rank`'s session id and weights info plus a digest of the raw body. When the digest equals
        `previous.digest` the answer is unchanged and `previous` comes back unparsed (the cheap per-sync test)."""
        response = await self._rank_response(rank, timeout)
        digest = hashlib.blake2b(response.content, digest_size=16).hexdigest()
        if previous is not None and previous.digest == digest:
            return previous
        return RankAnswer(digest, self._parse_rank(response, rank))

    async def get_rank_info(self, rank: int, timeout: float | None = None) -> RemoteRankInfo:
        return (await self.rank_answer(rank, timeout=timeout)).info

    async def _rank_response(self, rank: int, timeout: float | None) -> Response:
        params = {"rank": int(rank)}
        if self.bootstrap_url and self._bootstrap_reachable:
            try:
                return await self.request(
                    "GET", "/get_transfer_engine_info", params=params, base=self.bootstrap_url, timeout=timeout
                )
            except RolloutCallError as exc:
                if exc.status is not None:
                    raise
                self._bootstrap_reachable = False
                self._warn_once(
                    "bootstrap",
                    f"bootstrap server {self.bootstrap_url} unreachable ({exc.message}); reading rank info through "
                    f"{self.url}/remote_instance_transfer_engine_info instead (SGLang binds the bootstrap server "
                    "to server_args.host; set host to a reachable address to skip the proxy)",
                )
        _, response = await self._first_route(
            "GET",
            ("/remote_instance_transfer_engine_info", "/get_remote_instance_transfer_engine_info"),
            params=params,
            timeout=timeout,
        )
        return response

    def _parse_rank(self, response: Response, rank: int) -> RemoteRankInfo:
        try:
            return RemoteRankInfo.from_json(response.json())
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            url = urlsplit(response.url)
            raise RolloutCallError(
                f"{url.scheme}://{url.netloc}",
                "GET",
                f"{url.path}?{url.query}",
                response.status_code,
                f"rank {rank}: malformed transfer-engine info ({type(exc).__name__}: {exc}): {response.text[:200]!r}",
                "expected {'remote_instance_transfer_engine_info': [session_id, {name: [address, numel, size]}]}",
            ) from exc


def _json_or_text(response: Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


async def _closer(session: aiohttp.ClientSession, loop: asyncio.AbstractEventLoop) -> AsyncGenerator[None]:
    """Closes `session` when finalised: by the loop's shutdown_asyncgens(), by close(), or by _finish()."""
    try:
        yield
    finally:
        if not loop.is_closed():
            await session.close()


async def _aclose(closer: AsyncGenerator) -> None:
    await closer.aclose()


def _finish(closer: AsyncGenerator) -> None:
    """Finalise a closer without a loop: its loop is closed (so its sockets cannot be closed through it) or
    its session already is; either way its finally block awaits nothing and ends at once."""
    step = closer.aclose()
    try:
        step.send(None)
    except StopIteration:
        return
    except RuntimeError:  # never started, or finished elsewhere meanwhile
        return
    step.close()


_ERRNO_REASONS = {
    errno.ECONNREFUSED: "connection refused",
    errno.EHOSTUNREACH: "no route to host",
    errno.ECONNRESET: "connection reset",
}


def _reason(exc: Exception) -> str:
    cause = getattr(exc, "os_error", None) or exc
    if isinstance(cause, socket.gaierror) or isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "name or service not known"
    if getattr(cause, "errno", None) in _ERRNO_REASONS:
        return _ERRNO_REASONS[cause.errno]
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    text = f"{exc} {cause}" if cause is not exc else str(exc)
    if f"[Errno {errno.ECONNREFUSED}]" in text:  # asyncio joins the errors of every address it tried
        return "connection refused"
    for marker in ("Connection refused", "Name or service not known", "No route to host", "Connection reset"):
        if marker in text:
            return marker.lower()
    return text[:200]
