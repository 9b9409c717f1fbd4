"""P2PReplicaAdapter: one rollout replica (SGLang engine) as the sync lifecycle sees it.

Built from a verl 0.9.1 `RolloutReplica` (node 0's HTTP address, the bootstrap port from the SGLang engine
kwargs) or from a bare engine index + URL. It knows nothing about step order (lifecycle.py does); each method
is one control-plane action on this engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from verl_p2p.config import P2PConfig
from verl_p2p.planning.layout import RankLayout, check_server_info, layout_from_server_args
from verl_p2p.planning.targets import RemoteRankInfo
from verl_p2p.rollout.client import RankAnswer, RolloutCallError, ServerKeys, SGLangClient, normalize_url
from verl_p2p.sglang_versions import has_sessions

DEFAULT_BOOTSTRAP_PORT = 6789  # SGLang's ServerArgs.engine_info_bootstrap_port default (0.5.12 - 0.5.23)
FLUSH_BUSY = 400  # SGLang's /flush_cache answer while requests still run or wait
_FLUSH_HINT = (
    "the server kept requests running or queued while paused; with pause_mode=retract, SGLang before 0.5.23 keeps "
    "the retracted requests queued and cannot flush until they finish: use pause_mode=abort, or raise http_timeout"
)


class P2PReplicaAdapter:
    """One rollout engine: its index (the `engine` of every TargetRank it owns) and its SGLang client."""

    def __init__(
        self,
        engine: int,
        url: str,
        *,
        bootstrap_url: str | None = None,
        config: P2PConfig | None = None,
        client: SGLangClient | None = None,
        keys: ServerKeys | None = None,
    ):
        self.engine = int(engine)
        self.config = config or P2PConfig()
        keys = keys or server_keys(self.config, {})
        self.client = client or SGLangClient(
            url,
            bootstrap_url=bootstrap_url,
            api_key=keys.api_key,
            admin_api_key=keys.admin_api_key,
            timeout=self.config.http_timeout,
        )
        self._server_info: dict[str, Any] | None = None

    @classmethod
    def from_replica(cls, replica: Any, config: P2PConfig | None = None) -> P2PReplicaAdapter:
        """From a verl RolloutReplica after `launch_servers`: `server_address` is node 0's `host:port`; the
        bootstrap server runs on node 0 at `engine_kwargs.sglang.engine_info_bootstrap_port`, bound to
        `engine_kwargs.sglang.host` (SGLang default 127.0.0.1: then the client falls back to the control
        plane's proxy route when the driver is on another host)."""
        address = replica.server_address
        if not address:
            raise ValueError(f"rollout replica {replica.replica_rank} has no server address: launch its servers first")
        sglang_kwargs = _sglang_engine_kwargs(replica.config)
        config = config or P2PConfig()
        port = int(sglang_kwargs.get("engine_info_bootstrap_port") or DEFAULT_BOOTSTRAP_PORT)
        host = sglang_kwargs.get("host")
        if not host or host in ("0.0.0.0", "::"):
            host = normalize_url(address).split("://", 1)[1].rsplit(":", 1)[0]
        keys = server_keys(config, sglang_kwargs)
        return cls(replica.replica_rank, address, bootstrap_url=f"{host}:{port}", config=config, keys=keys)

    @classmethod
    def for_rollout(cls, engine: int, url: str, config: P2PConfig, rollout_config: Any) -> P2PReplicaAdapter:
        """A rollout leader's adapter of its own server (the engine path): the keys from verl's rollout config,
        as the server was started with them."""
        return cls(engine, url, config=config, keys=server_keys(config, _sglang_engine_kwargs(rollout_config)))

    def __str__(self) -> str:
        return f"engine {self.engine} ({self.url})"

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def sessions_supported(self) -> bool | None:
        """False once the server answered 404 to begin/end (SGLang < 0.5.21): post-load processing won't run."""
        return self.client.sessions_supported

    @property
    def sessions_expected(self) -> bool | None:
        """`sessions_supported` once known, else what the server's release says (`sglang_versions.SESSIONS_SINCE`):
        what a plan made before the first begin assumes, so the begin's answer does not re-plan in the pause."""
        if self.client.sessions_supported is not None:
            return self.client.sessions_supported
        return has_sessions(self.server_version)

    # ---- lifecycle actions ---------------------------------------------------------------------------------

    async def pause(self, mode: str | None = None) -> None:
        await self.client.pause_generation(mode or self.config.pause_mode)

    async def release_kv(self) -> None:
        await self.client.release_memory_occupation(("kv_cache",))

    async def begin_session(self) -> bool:
        return await self.client.begin_weight_update()

    async def bump_version(self, version: str) -> None:
        await self.client.update_weight_version(str(version), abort_all_requests=False)

    async def end_session(self) -> bool:
        return await self.client.end_weight_update()

    async def resume_kv(self) -> None:
        await self.client.resume_memory_occupation(("kv_cache",))

    async def resume(self) -> None:
        await self.client.continue_generation()

    async def flush_cache(self) -> int:
        """Drop the prefix (radix) cache, whose KV was computed with the old weights; returns the attempts made.

        SGLang flushes it after every weight update it performs itself, but p2p writes bypass its loader, so the
        sync must. SGLang answers 400 while requests still run or wait (aborted ones not yet reaped), so a 400 is
        retried until `http_timeout` has passed since the first try; any other error, or a 400 past that
        deadline, raises naming the server."""
        deadline = time.monotonic() + self.config.http_timeout
        delay, attempts = 0.05, 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            try:
                await self.client.flush_cache(timeout=max(left, 0.01))
                return attempts
            except RolloutCallError as exc:
                if exc.status != FLUSH_BUSY:
                    raise
                if time.monotonic() + delay >= deadline:
                    raise RolloutCallError(
                        exc.server,
                        exc.method,
                        exc.route,
                        exc.status,
                        f"cache still not flushed after {attempts} attempt(s) in {self.config.http_timeout:g} s: "
                        f"{exc.message}",
                        _FLUSH_HINT,
                    ) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def weights_checker(self, action: str, **fields: Any) -> Any:
        return await self.client.weights_checker(action, **fields)

    # ---- metadata ------------------------------------------------------------------------------------------

    async def server_info(self, refresh: bool = False) -> dict[str, Any]:
        """`/server_info`, cached: server args do not change while the server lives."""
        if self._server_info is None or refresh:
            info = await self.client.server_info()
            check_server_info(info, str(self))  # a malformed answer: a named P2PError, before any use of it
            self._server_info = info
        return self._server_info

    def forget(self) -> None:
        """Drop cached server info (the server may have been replaced)."""
        self._server_info = None

    @property
    def cached_server_info(self) -> dict[str, Any]:
        if self._server_info is None:
            raise RuntimeError(f"{self}: server info not fetched yet (await server_info() first)")
        return self._server_info

    @property
    def server_version(self) -> str | None:
        """SGLang release of the server (`version` in `/server_info`), once server info was fetched."""
        return None if self._server_info is None else self._server_info.get("version")

    @property
    def num_ranks(self) -> int:
        """Model-runner ranks of this engine (tp_size; rollout PP is 1), once server info was fetched."""
        info = self.cached_server_info
        return int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1)

    async def ranks(self) -> range:
        await self.server_info()
        return range(self.num_ranks)

    async def layouts(self) -> dict[int, RankLayout]:
        info = await self.server_info()
        return {rank: layout_from_server_args(info, rank) for rank in range(self.num_ranks)}

    async def rank_answers(self, previous: Mapping[int, RankAnswer] | None = None) -> dict[int, RankAnswer]:
        """Every rank's answer in parallel; ranks whose raw answer is unchanged return `previous[rank]` as is."""
        ranks = await self.ranks()
        previous = previous or {}
        answers = await asyncio.gather(*(self.client.rank_answer(r, previous.get(r)) for r in ranks))
        return dict(zip(ranks, answers, strict=True))

    async def rank_infos(self) -> dict[int, RemoteRankInfo]:
        return {rank: answer.info for rank, answer in (await self.rank_answers()).items()}

    def close(self) -> None:
        self.client.close()


def adapters_from_replicas(replicas: Sequence[Any], config: P2PConfig | None = None) -> list[P2PReplicaAdapter]:
    return [P2PReplicaAdapter.from_replica(r, config) for r in replicas]


def server_keys(config: P2PConfig, sglang_kwargs: Mapping[str, Any]) -> ServerKeys:
    """The keys a server launched with `engine_kwargs.sglang` checks: its `api_key` and `admin_api_key`; p2p's
    `api_key` option, when set, is the admin key (and the only key when the server args name none)."""
    return ServerKeys(
        api_key=sglang_kwargs.get("api_key") or None,
        admin_api_key=config.api_key or sglang_kwargs.get("admin_api_key") or None,
    )


def _sglang_engine_kwargs(rollout_config: Any) -> dict[str, Any]:
    """`rollout.engine_kwargs.sglang` as a plain dict, from a dataclass, dict or OmegaConf config."""
    engine_kwargs = _get(rollout_config, "engine_kwargs") or {}
    sglang_kwargs = _get(engine_kwargs, "sglang") or {}
    return dict(sglang_kwargs.items()) if isinstance(sglang_kwargs, Mapping) else {}


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):  # dict or OmegaConf DictConfig
        return obj.get(key)
    return getattr(obj, key, None)
