"""Build a tiny Megatron model through Megatron-Bridge in real gloo (CPU) or NCCL (GPU) groups (demo and tests).

Demo and test support only (never on the production path). Stand-ins, each because the real part cannot
run without transformer_engine or a GPU:

- `transformer_engine` is an import-only stub (`install_te_stub`). Megatron-Bridge imports TE at module level
  (its LoRA layers), but megatron-core decides HAVE_TE when its model modules are first imported: those are
  imported *before* the stub exists, so megatron-core still builds the local (TE-free) layers and a final norm
  with parameters. Imported the other way round, the export silently loses `model.norm.weight`.
- CPU only, while the model is built and loaded: `Tensor.cuda` / `Module.cuda` are the identity and
  `torch.cuda.current_device()` answers None (`_cuda_is_identity`).
- Without TE: MTP blocks get megatron-core's local spec (the bridge asks for TE's unconditionally), and
  Qwen3Bridge learns the local names of its MTP layer norms (`add_local_mtp_layernorm_mappings`).

Everything else is real: parallel_state groups, the bridge's provider, its HF weight loading and export.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import os
import re
import socket
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

# megatron-core modules that probe for transformer_engine at import time; imported before the stub exists.
_MCORE_TE_PROBES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.fp8_utils",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.moe_module_specs",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.distributed",
)


class _StubModule(types.ModuleType):
    """A module whose every missing attribute is a placeholder class (CamelCase) or a child stub module."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value: Any = type(name, (), {"__module__": self.__name__})
        else:
            value = _StubModule(f"{self.__name__}.{name}")
            sys.modules[value.__name__] = value
        setattr(self, name, value)
        return value


def te_is_stub() -> bool:
    return isinstance(sys.modules.get("transformer_engine"), _StubModule)


def install_te_stub() -> bool:
    """Import megatron-core's model modules, then stub `transformer_engine` if it is not installed.

    Returns True when the stub was installed (False: real TE present, or already stubbed earlier).
    """
    for name in _MCORE_TE_PROBES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    if "transformer_engine" in sys.modules:
        return False
    try:
        importlib.import_module("transformer_engine")
        return False
    except ImportError:
        pass
    root = _stub_package("transformer_engine")
    root.__version__ = "0.0.0+stub"
    for sub in ("pytorch", "pytorch.ops", "common", "common.recipe"):
        mod = _stub_package(f"transformer_engine.{sub}")
        parent, _, leaf = mod.__name__.rpartition(".")
        setattr(sys.modules[parent], leaf, mod)
    return True


def _stub_package(name: str) -> _StubModule:
    # a package with a spec: `import transformer_engine.pytorch` and importlib.util.find_spec (peft) both work
    mod = _StubModule(name)
    mod.__path__ = []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    sys.modules[name] = mod
    return mod


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world: int, port: int, backend: str = "gloo", timeout_s: float = 300) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.distributed.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=timeout_s),
    )


@dataclass(frozen=True)
class Parallel:
    """Megatron parallel sizes of one tiny model."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None


@contextlib.contextmanager
def _cuda_is_identity() -> Iterator[None]:
    """CPU only, while the model is built and loaded: megatron-core calls `.cuda()` on the tied output weight
    under PP>1, and the bridge's replicated-weight loader compares against `torch.cuda.current_device()` under
    TP>1. Keep tensors where they are, and report "no device index" (what a CPU tensor's `.index` is)."""
    saved = torch.Tensor.cuda, torch.nn.Module.cuda, torch.cuda.current_device
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.nn.Module.cuda, torch.cuda.current_device = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def _local_mtp_spec() -> Iterator[None]:
    """Without TE: Megatron-Bridge builds MTP blocks with TE's spec provider unconditionally; use the local one
    (the same layer structure the local decoder layers use)."""
    from megatron.bridge.models import gpt_provider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    saved = gpt_provider.mtp_block_spec

    def local_mtp_block_spec(config: Any, vp_stage: int | None = None) -> Any:
        if not getattr(config, "mtp_num_layers", None):
            return None
        spec = config.transformer_layer_spec(config)
        return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)

    gpt_provider.mtp_block_spec = local_mtp_block_spec
    try:
        yield
    finally:
        gpt_provider.mtp_block_spec = saved


_MTP_LOCAL_LAYERNORMS = {
    # TE fuses these norms into the next linear; Qwen3Bridge maps only those fused names for its MTP layer
    # (literal layer 0, so the registry's separate-layernorm aliases do not apply). Local-spec names:
    "mtp.layers.0.mtp_model_layer.input_layernorm.weight": "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.mtp_model_layer.pre_mlp_layernorm.weight": "mtp.layers.0.post_attention_layernorm.weight",
}


def add_local_mtp_layernorm_mappings() -> None:
    """Without TE: teach Qwen3Bridge the local-spec names of its MTP layer norms (idempotent)."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from megatron.bridge.models.qwen.qwen3_bridge import Qwen3Bridge

    if getattr(Qwen3Bridge.mapping_registry, "__local_mtp__", False):
        return
    original = Qwen3Bridge.mapping_registry

    def mapping_registry(self: Any) -> Any:
        mappings = list(original(self).mappings)
        mappings += [AutoMapping(megatron_param=m, hf_param=h) for m, h in _MTP_LOCAL_LAYERNORMS.items()]
        return MegatronMappingRegistry(*mappings)

    mapping_registry.__local_mtp__ = True  # type: ignore[attr-defined]
    Qwen3Bridge.mapping_registry = mapping_registry  # type: ignore[method-assign]


_GROUPED_EXPERT = re.compile(r"^(?P<head>.*\.mlp\.experts)\.(?P<fc>linear_fc[12])\.weight\*$")


def add_local_expert_mappings(bridge_cls: type) -> None:
    """Teach a bridge megatron-core's local expert names (idempotent).

    Some bridges (GLM-4.5's) map only TE's grouped experts (`experts.linear_fc1.weight<E>`); the local spec builds
    a SequentialMLP (`experts.local_experts.<E>.linear_fc1.weight`). Each grouped per-expert mapping gets its
    local twin with the same HF names, where the bridge has none."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

    if getattr(bridge_cls.mapping_registry, "__local_experts__", False):
        return
    original = bridge_cls.mapping_registry

    def mapping_registry(self: Any) -> Any:
        mappings = list(original(self).mappings)
        have = {m.megatron_param for m in mappings}
        for m in list(mappings):
            match = _GROUPED_EXPERT.match(m.megatron_param)
            if match is None:
                continue
            local = f"{match['head']}.local_experts.*.{match['fc']}.weight"
            if local in have:
                continue
            if type(m) is GatedMLPMapping:
                mappings.append(GatedMLPMapping(megatron_param=local, gate=m.hf_param["gate"], up=m.hf_param["up"]))
            elif type(m) is AutoMapping:
                mappings.append(AutoMapping(megatron_param=local, hf_param=m.hf_param))
            else:  # fused HF experts (one tensor for all experts): no per-expert twin
                continue
            have.add(local)
        return MegatronMappingRegistry(*mappings)

    mapping_registry.__local_experts__ = True  # type: ignore[attr-defined]
    bridge_cls.mapping_registry = mapping_registry  # type: ignore[method-assign]


def _mla_local_attention() -> type:
    """megatron-core's local DotProductAttention with MLA's own head dims.

    MLASelfAttention hands its core attention `k_channels` (q/k head dim) and `v_channels`; only TE's attention
    takes them. The local one's math is head-dim agnostic but sizes its output by `kv_channels`: size it by
    `v_channels` instead. No parameters, so the export is untouched."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_attention_head = v_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def _mla_local_self_attention() -> type:
    """MLASelfAttention whose q projection without a q LoRA (DeepSeek-V2) is a plain linear.

    megatron-core's norm resolver wants a fused norm+linear `linear_q_proj` there (TE's; the local backend has
    none) and rejects a standalone q norm; the HF model has no q norm at all without a q LoRA. The kv side
    keeps its standalone norm (`kv_a_layernorm`), as the resolver builds it with a q LoRA."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LocalMLASelfAttention(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
            if self.config.q_lora_rank is not None or not self.config.qk_layernorm:
                return super()._resolve_qk_norm_config(submodules)
            return dict(
                linear_q_proj=submodules.linear_q_proj,
                linear_q_up_proj=IdentityOp,
                linear_kv_up_proj=submodules.linear_kv_up_proj,
                q_layernorm=IdentityOp,
                kv_layernorm=submodules.kv_layernorm,
            )

    return LocalMLASelfAttention


def _local_decoder_block_spec(config: Any, vp_stage: int | None = None, pp_rank: int | None = None) -> Any:
    """The bridge's per-layer block spec (dense first layers from `moe_layer_freq`) with megatron-core's local
    modules, MLA layers with an attention that takes MLA's head dims."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage, pp_rank=pp_rank
    )
    attention, mla = _mla_local_attention(), _mla_local_self_attention()
    layers = []
    for layer in block.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module is MLASelfAttention:
            sub = dataclasses.replace(attn.submodules, core_attention=attention)
            attn = dataclasses.replace(attn, module=mla, submodules=sub)
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))
        layers.append(layer)
    return dataclasses.replace(block, layer_specs=layers)


def _local_spec(bridge_spec: Any) -> Any:
    """Without TE, the local counterpart of the spec the bridge chose: a per-layer block spec stays one (a single
    layer spec would make every layer MoE and the dense layers' HF tensors unloadable)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if getattr(bridge_spec, "func", None) is get_gpt_decoder_block_spec:
        return _local_decoder_block_spec
    return local_layer_spec


def build_tiny_megatron(
    hf_dir: str | Path,
    par: Parallel,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    timeout_s: float | None = None,
) -> tuple[list[torch.nn.Module], Any]:
    """(model chunks, AutoBridge) of the HF checkpoint at `hf_dir`, weights loaded by the bridge.

    Initialises megatron's parallel_state on the already initialised default group (destroying a previous one);
    `timeout_s`: its groups' timeout, as a trainer sets `distributed_timeout_minutes` (default: megatron's).
    """
    install_te_stub()
    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        **({} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}),
    )
    if device != "cpu":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)

    bridge = AutoBridge.from_hf_pretrained(str(hf_dir), torch_dtype=dtype)
    add_local_expert_mappings(type(bridge._model_bridge))
    provider = bridge.to_megatron_provider(load_weights=True)
    on_cpu = device == "cpu"
    overrides = dict(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        transformer_layer_spec=_local_spec(provider.transformer_layer_spec),
        transformer_impl="local",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        cross_entropy_loss_fusion=False,
        moe_token_dispatcher_type="allgather",
        moe_shared_expert_overlap=False,
        sequence_parallel=False,
    )
    for key, value in overrides.items():
        if hasattr(provider, key):
            setattr(provider, key, value)
    provider.finalize()
    with contextlib.ExitStack() as stack:
        if on_cpu:
            stack.enter_context(_cuda_is_identity())
        if te_is_stub():
            stack.enter_context(_local_mtp_spec())
            add_local_mtp_layernorm_mappings()
        modules = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=on_cpu, mixed_precision_wrapper=None
        )
    return modules, bridge


# ---------------------------------------------------------------------------------------------------------------
# Process groups for tests: spawn N processes, run `fn(rank, world, port, *args)` in each, collect the results.


def _child(fn: Callable, rank: int, world: int, port: int, args: tuple, queue) -> None:
    try:
        queue.put((rank, "ok", fn(rank, world, port, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_group(fn: Callable, world: int, *args, timeout_s: float = 240) -> list[Any]:
    """Run `fn` in `world` processes (forked from a preloaded template: sandbox/forked.py); return their results
    by rank, or raise with every failure.

    A group not finished after `timeout_s` (a hang) is killed and reported as such; so is one whose rank failed
    or died (its peers may wait on it forever).
    """
    import queue as queue_mod
    import time

    from verl_p2p.sandbox import forked

    queue = forked.context().Queue()
    port = free_port()
    procs = [forked.process(_child, (fn, r, world, port, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = queue.get(timeout=min(max(deadline - time.monotonic(), 0.1), 5))
            except queue_mod.Empty:
                if errors or any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            (results if status == "ok" else errors)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=1 if errors else 10)
        for p in procs:  # only the processes started here
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    missing = [r for r in range(world) if r not in results]
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout_s}s (hang?) or died")
    return [results[r] for r in range(world)]


@dataclass
class ShellModelConfig:
    """The two fields of verl's HFModelConfig the p2p trainer source reads."""

    hf_config: Any
    local_path: str


def megatron_engine_shell(
    hf_dir: str | Path,
    parallel: Parallel | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    timeout_s: float | None = None,
) -> Any:
    """verl's real MegatronEngine class holding a Megatron-Bridge model of `hf_dir`, this rank's part of the already
    initialised default process group.

    MegatronEngine's own constructor builds an optimizer and needs a full verl worker config; the p2p source reads
    only three attributes (module chunks, bridge, model config), filled in here on an instance made without it.
    """
    from transformers import AutoConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    modules, bridge = build_tiny_megatron(
        hf_dir, parallel or Parallel(), device=device, dtype=dtype, timeout_s=timeout_s
    )
    engine = object.__new__(MegatronEngine)
    engine.module, engine.bridge = modules, bridge
    engine.model_config = ShellModelConfig(AutoConfig.from_pretrained(hf_dir), str(hf_dir))
    return engine
