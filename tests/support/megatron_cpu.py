"""Moved to verl_p2p.cpu_megatron (the demo needs it too); kept for the test modules' imports."""

from verl_p2p.cpu_megatron import Parallel, build_tiny_megatron, init_distributed, install_te_stub, run_group

__all__ = ["Parallel", "build_tiny_megatron", "init_distributed", "install_te_stub", "run_group"]
