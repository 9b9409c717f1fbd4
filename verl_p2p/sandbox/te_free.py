"""verl's Megatron actor without transformer_engine: the tiny GRPO run on a GPU host that lacks TE.

Stand-in, named as such (never on the production path): the H200 machine has no transformer_engine, and TE's
torch extension only builds from source. verl 0.9.1 builds its Megatron actor through Megatron-Bridge, which
imports TE at module level (its LoRA layers) and asks megatron-core for TE's layer spec. Enabled with
`VERL_USE_EXTERNAL_MODULES=verl_p2p.sandbox.te_free` (verl imports it in every process right after `import verl`;
a plain import changes nothing), this module, only where TE is not installed and only once a process imports
`megatron.bridge`:

- imports megatron-core's TE-probing modules first, so they see no TE (HAVE_TE=False, torch's AdamW, no fused
  kernels), then shows Megatron-Bridge the import-only TE stub of `cpu_megatron` for the length of its own import
  and removes it again: later `import transformer_engine` fails as on any host without TE;
- makes Megatron-Bridge's default GPT layer spec megatron-core's local spec with `CausalDotProductAttention`:
  megatron-core's own attention under the `causal` mask, the padding mask dropped. That is what TE's attention
  does for the `causal` mask type: verl's BSHD batches are right-padded, so under a causal mask padding never
  reaches a real token.

The local layers need verl's BSHD path and no TE/apex fusions; the recipe sets them (`te_free_overrides()`), and
the layer spec refuses, naming the override, a config that still asks for one.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

from verl_p2p.errors import P2PConfigError

# megatron-core modules that decide at import time whether TE exists (HAVE_TE, optimizer classes, fused kernels).
MCORE_TE_PROBES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.fp8_utils",
    "megatron.core.fp4_utils",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.cuda_graphs",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.moe_module_specs",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.optimizer_config",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.exchange_utils",
)

# Hydra overrides the TE-free layers need (config field -> value), under actor_rollout_ref.actor.megatron.
REQUIRED_FALSE = (
    "gradient_accumulation_fusion",  # needs TE or apex's fused_weight_gradient_mlp_cuda
    "masked_softmax_fusion",  # megatron's fused softmax kernels are not built
    "persist_layer_norm",  # torch's RMSNorm refuses it
    "apply_rope_fusion",  # TE's fused RoPE
    "bias_activation_fusion",
    "bias_dropout_fusion",
)


def te_installed() -> bool:
    return "transformer_engine" in sys.modules or importlib.util.find_spec("transformer_engine") is not None


def te_free_overrides(prefix: str = "actor_rollout_ref.actor.megatron") -> list[str]:
    """The Hydra overrides of a verl Megatron run on the TE-free layers (BSHD batches, fusions off)."""
    out = [f"{prefix}.use_remove_padding=false"]
    out += [f"+{prefix}.override_transformer_config.{name}=false" for name in REQUIRED_FALSE]
    out.append(f"+{prefix}.override_transformer_config.transformer_impl=local")
    return out


def causal_dot_product_attention() -> type:
    """megatron-core's DotProductAttention that applies the causal mask only (see the module docstring)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class CausalDotProductAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):
            if self.attn_mask_type == AttnMaskType.causal:
                attention_mask = None  # softmax builds the causal mask itself
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type, **kwargs)

    CausalDotProductAttention.__module__ = __name__
    CausalDotProductAttention.__qualname__ = "CausalDotProductAttention"
    return CausalDotProductAttention


_ATTENTION: type | None = None


def te_free_layer_spec(config: Any) -> Any:
    """Megatron-Bridge's `transformer_engine_layer_spec` replacement: the local spec, causal core attention."""
    global _ATTENTION
    on = [name for name in REQUIRED_FALSE if getattr(config, name, False)]
    if on:
        raise P2PConfigError(
            f"verl_p2p.sandbox.te_free: {', '.join(on)} need transformer_engine/apex, which this host lacks: set "
            + " ".join(f"+actor_rollout_ref.actor.megatron.override_transformer_config.{n}=false" for n in on)
        )
    from megatron.bridge.models.gpt_provider import local_layer_spec

    if _ATTENTION is None:
        _ATTENTION = causal_dot_product_attention()
    spec = local_layer_spec(config)
    spec.submodules.self_attention.submodules.core_attention = _ATTENTION
    return spec


def import_mcore_probes() -> None:
    for name in MCORE_TE_PROBES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


@contextlib.contextmanager
def _stub_while_importing():
    """The import-only TE stub, visible only inside the block (megatron-core's probes already ran)."""
    from verl_p2p.sandbox.cpu_megatron import install_te_stub, te_is_stub

    import_mcore_probes()
    installed = install_te_stub()
    try:
        yield
    finally:
        if installed and te_is_stub():
            for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
                del sys.modules[name]


class _Loader(importlib.abc.Loader):
    """Runs a module's own loader, with `before` (a context manager factory) around it and `after` past it."""

    def __init__(self, inner: importlib.abc.Loader, before=None, after=None):
        self.inner, self.before, self.after = inner, before, after

    def __getattr__(self, name: str) -> Any:  # get_code, get_resource_reader, is_package, ...
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        with self.before() if self.before else contextlib.nullcontext():
            self.inner.exec_module(module)
        if self.after:
            self.after(module)


def _patch_gpt_provider(module: Any) -> None:
    module.transformer_engine_layer_spec = te_free_layer_spec  # default_layer_spec looks it up at call time


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps the loaders of `megatron.bridge` (stub during its import) and its gpt_provider (patched after)."""

    wrap = {"megatron.bridge": dict(before=_stub_while_importing), "megatron.bridge.models.gpt_provider": {}}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.wrap:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        extra = self.wrap[fullname] or dict(after=_patch_gpt_provider)
        spec.loader = _Loader(spec.loader, **extra)
        return spec


def enable() -> bool:
    """Arrange the TE-free Megatron for this process; False when TE is installed (nothing to do)."""
    if te_installed():
        return False
    if any(isinstance(f, _Hook) for f in sys.meta_path):
        return True
    if "megatron.bridge.models.gpt_provider" in sys.modules:
        _patch_gpt_provider(sys.modules["megatron.bridge.models.gpt_provider"])
    sys.meta_path.insert(0, _Hook())
    return True


if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").replace(" ", "").split(","):
    enable()  # imported by verl for this purpose; a plain import (the recipe test, te_free_overrides) changes nothing
