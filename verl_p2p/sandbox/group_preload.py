"""What every rank of a test process group (`cpu_megatron.run_group`) imports, imported once in the template
process its ranks are forked from.

A freshly spawned rank spends most of its CPU importing torch, Megatron-Bridge and SGLang's model loader before its
few milliseconds of work; forked from a template that already holds them, it starts with them imported. The
template sets up what a Megatron rank sets up first on a CPU host (megatron-core's TE probes, then the
transformer_engine stub; the CPU stand-in for vllm's ops, as every SGLang rank does); the other ranks (FSDP, the
replica's) never look for transformer_engine. Test-only: a GPU host's ranks are never started this way.
"""

from verl_p2p.sandbox.cpu_megatron import install_te_stub
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

install_te_stub()
install_cpu_stubs()

import megatron.bridge  # noqa: E402, F401
import sglang.srt.model_loader.loader  # noqa: E402, F401
