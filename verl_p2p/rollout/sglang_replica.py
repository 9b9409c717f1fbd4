"""P2PSGLangReplica: verl's SGLangReplica that launches p2p replicas with per-replica server args.

Registered over verl's `sglang` rollout replica (see plugin.register_replica). Its servers are verl's
SGLangHttpServer with p2p's launch checks and one repair (`launch.P2PServerLaunch`); with any backend other than
p2p it launches them as verl does. Imported only when verl resolves the replica class (it imports SGLang).
"""

from __future__ import annotations

import ray
from verl.workers.rollout import replica as _verl_replica
from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

from verl_p2p.rollout.launch import P2PServerLaunch, apply_to_replica

_load = getattr(_verl_replica.RolloutReplicaRegistry._registry.get("sglang"), "original", None)
SGLangReplica = (_load or _verl_replica._load_sglang)()


class P2PSGLangHttpServer(P2PServerLaunch, SGLangHttpServer):
    """verl's SGLang server actor; with p2p, checked before launch on the checkpoint it loads (platform,
    environment, FP8 platform) and `/server_info` repaired after (`launch.P2PServerLaunch`)."""


class P2PSGLangReplica(SGLangReplica):
    """SGLangReplica whose servers get p2p's server args (bootstrap port = base + replica_rank) before launch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(P2PSGLangHttpServer)

    async def launch_servers(self):
        apply_to_replica(self)
        await super().launch_servers()
