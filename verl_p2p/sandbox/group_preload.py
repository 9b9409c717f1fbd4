"""What every rank of a test process group (`cpu_megatron.run_group`) imports, imported once in the template
process its ranks are forked from.

A freshly spawned rank spends most of its CPU importing torch, Megatron-Bridge and SGLang's model loader before its
few milliseconds of work; forked from a template that already holds them, it starts with them imported. The
template imports exactly what the ranks set up themselves first (megatron-core's TE probes, then the
transformer_engine stub, the CPU stand-in for vllm's ops): no state a rank would not have made itself.
"""

from verl_p2p.sandbox.cpu_megatron import install_te_stub
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

install_te_stub()
install_cpu_stubs()

import megatron.bridge  # noqa: E402, F401
import sglang.srt.model_loader.loader  # noqa: E402, F401
