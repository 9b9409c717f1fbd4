"""End-to-end proof harness: the whole sync against a rollout you can stop, kill and compare (`verl-p2p e2e`).

Runs the real trainer side (a Megatron-Bridge model held by verl's MegatronEngine class, exported through the real
`SourceSession`, in a process of its own so a drill can kill it mid-push) and the real `SyncLifecycle` through
`P2PReplicaAdapter` into either real SGLang GPU servers (`--rollout sglang`) or loopback engines
(`--rollout loopback`, the CPU stand-in; same code path, no generation). Every sync is proven by the rollout's own
`weights_checker`, by checksums equal to those of a rollout started fresh from the same weights, and (real SGLang)
by greedy generations equal to that fresh rollout's. Failure drills check what each failure leaves behind and that
the next sync restores exact weights. Not on the production path.
"""
