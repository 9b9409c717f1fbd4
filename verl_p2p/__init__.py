"""verl-p2p: checkpoint-engine backend `p2p` (Megatron trainer -> SGLang rollout over Mooncake writes)."""

__version__ = "0.1.0"
