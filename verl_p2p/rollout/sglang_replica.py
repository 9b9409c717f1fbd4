"""P2PSGLangReplica: verl's SGLangReplica that launches p2p replicas with per-replica server args.

Registered over verl's `sglang` rollout replica (see plugin.register_replica). Its servers are verl's
SGLangHttpServer with one repair (`P2PSGLangHttpServer`); with any backend other than p2p it launches them as
verl does. Imported only when verl resolves the replica class (it imports SGLang).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import ray
from verl.workers.rollout import replica as _verl_replica
from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

from verl_p2p.rollout.launch import apply_to_replica

logger = logging.getLogger(__name__)

_load = getattr(_verl_replica.RolloutReplicaRegistry._registry.get("sglang"), "original", None)
SGLangReplica = (_load or _verl_replica._load_sglang)()


def repair_server_info() -> bool:
    """Make `/server_info` answer again on a server verl launched in-process (True when repaired).

    verl 0.9.1 keeps the third value of SGLang's `Engine._launch_subprocesses` as the scheduler info; from SGLang
    0.5.10 that value is the `PortArgs`, and `/server_info` (which merges the scheduler info into its answer)
    fails with HTTP 500 "'PortArgs' object is not a mapping". p2p reads the rollout's server args from that route,
    so a scheduler info that is not a mapping is replaced by an empty one: the answer keeps every server arg,
    the internal states and the version, which is all `/server_info` is read for.
    """
    from sglang.srt.entrypoints import http_server

    state = getattr(http_server, "_global_state", None)
    if state is None or isinstance(state.scheduler_info, Mapping):
        return False
    logger.warning(
        "verl_p2p: this server's scheduler info is a %s, not a mapping (verl 0.9.1 with SGLang >= 0.5.10): "
        "/server_info would answer 500; answering without it",
        type(state.scheduler_info).__name__,
    )
    state.scheduler_info = {}
    return True


class P2PSGLangHttpServer(SGLangHttpServer):
    """verl's SGLang server actor, with `/server_info` repaired after launch (`repair_server_info`)."""

    async def launch_server(self, *args, **kwargs):
        await super().launch_server(*args, **kwargs)
        repair_server_info()


class P2PSGLangReplica(SGLangReplica):
    """SGLangReplica whose servers get p2p's server args (bootstrap port = base + replica_rank) before launch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(P2PSGLangHttpServer)

    async def launch_servers(self):
        apply_to_replica(self)
        await super().launch_servers()
