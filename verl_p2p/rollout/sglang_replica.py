"""P2PSGLangReplica: verl's SGLangReplica that launches p2p replicas with per-replica server args.

Registered over verl's `sglang` rollout replica (see plugin.register_replica). Its servers are verl's
SGLangHttpServer with one repair (`P2PSGLangHttpServer`); with any backend other than p2p it launches them as
verl does. Imported only when verl resolves the replica class (it imports SGLang).
"""

from __future__ import annotations

import ray
from verl.workers.rollout import replica as _verl_replica
from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

from verl_p2p.rollout.launch import (
    apply_to_replica,
    check_server_process,
    repair_scheduler_info,
    sglang_kwargs,
    uses_p2p,
)

_load = getattr(_verl_replica.RolloutReplicaRegistry._registry.get("sglang"), "original", None)
SGLangReplica = (_load or _verl_replica._load_sglang)()


def platform_node() -> str:
    import socket

    return socket.gethostname()


class P2PSGLangHttpServer(SGLangHttpServer):
    """verl's SGLang server actor, with `/server_info` repaired after launch (`launch.repair_scheduler_info`);
    with p2p, what only its host knows is checked first (`launch.check_server_process`: platform, environment,
    FP8 platform)."""

    async def launch_server(self, *args, **kwargs):
        if uses_p2p(self.config):  # where the server runs: its post-load processing must keep p2p's bytes
            hf_config = getattr(getattr(self, "model_config", None), "hf_config", None)
            check_server_process(sglang_kwargs(self.config), hf_config, f"rollout server on {platform_node()}")
        await super().launch_server(*args, **kwargs)
        from sglang.srt.entrypoints import http_server

        repair_scheduler_info(getattr(http_server, "_global_state", None))


class P2PSGLangReplica(SGLangReplica):
    """SGLangReplica whose servers get p2p's server args (bootstrap port = base + replica_rank) before launch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(P2PSGLangHttpServer)

    async def launch_servers(self):
        apply_to_replica(self)
        await super().launch_servers()
