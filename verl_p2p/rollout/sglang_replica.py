"""P2PSGLangReplica: verl's SGLangReplica that launches p2p replicas with per-replica server args.

Registered over verl's `sglang` rollout replica (see plugin.register_replica). With any backend other than
`p2p` it is verl's class unchanged. Imported only when verl resolves the replica class (it imports SGLang).
"""

from __future__ import annotations

from verl.workers.rollout import replica as _verl_replica

from verl_p2p.rollout.launch import apply_to_replica

_load = getattr(_verl_replica.RolloutReplicaRegistry._registry.get("sglang"), "original", None)
SGLangReplica = (_load or _verl_replica._load_sglang)()


class P2PSGLangReplica(SGLangReplica):
    """SGLangReplica whose servers get p2p's server args (bootstrap port = base + replica_rank) before launch."""

    async def launch_servers(self):
        apply_to_replica(self)
        await super().launch_servers()
