"""SGLang settings under which the rollout serves from copies of its weights that in-place writes never refresh.

SGLang 0.5.21 / 0.5.23 refuse their own online-update APIs while such a "derived-weight cache" is active
(`model_runner_components/weight_updater.py`: `_unsupported_derived_weight_cache_error`,
`_assert_weight_cache_inactive`), but `/begin_weight_update` / `/end_weight_update` do not ask, and p2p writes the
published memory directly: the sync would succeed, checksums would match, and the forward would keep the old
weights. No release exposes these caches as a list a client can read (they are attributes SGLang sets on the
live GPU model), so p2p keeps the settings that turn them on here and refuses each by name, before launch (the
driver's config, the server process's environment) and at connect (the live server args).
A setting the rollout's SGLang does not know is simply absent (0.5.12 has none of these args): nothing to refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "y", "on")


def _on(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)


@dataclass(frozen=True)
class DerivedWeightCache:
    """One SGLang setting that makes the rollout serve from weights derived once, with the fix that avoids it."""

    setting: str  # a ServerArgs field (server_arg) or an environment variable (env)
    kind: str  # "server_arg" | "env"
    active: Callable[[Any], bool]  # given the setting's value (None when unset)
    cache: str  # what SGLang keeps, in its own words
    source: str  # where SGLang 0.5.23 sets the cache up
    fix: str
    harm: str = "which p2p's in-place writes never refresh, so the rollout would keep serving the old weights"

    def problem(self, value: Any) -> str | None:
        if value is None or not self.active(value):
            return None
        return (
            f"{self.setting}={value!r}: {self.cache}, {self.harm} (SGLang refuses its own update APIs here, "
            f"{self.source}). Fix: {self.fix}"
        )


SERVER_ARG_CACHES: tuple[DerivedWeightCache, ...] = (
    DerivedWeightCache(
        "enable_nvidia_megakernel",
        "server_arg",
        _on,
        "the NVIDIA megakernel's captured kernels keep state derived from the weights",
        "sglang/srt/kernel_plugins/nvidia/binding.py:431",
        "launch the rollout without --enable-nvidia-megakernel",
    ),
    DerivedWeightCache(
        "enable_amd_monokernel",
        "server_arg",
        _on,
        "the AMD monokernels keep weight copies",
        "sglang/srt/kernel_plugins/amd/binding.py:411",
        "launch the rollout without --enable-amd-monokernel (--monokernel-backend amd)",
    ),
    DerivedWeightCache(
        "enable_paged_experts",
        "server_arg",
        _on,
        "experts already paged onto the GPU keep their old weights",
        "sglang/srt/layers/moe/paged_experts/method.py:103",
        "launch the rollout without --enable-paged-experts",
    ),
    DerivedWeightCache(
        "weight_cache_mode",
        "server_arg",
        lambda value: str(value) != "off",
        "the weights are the weight-cache daemon's master copy, shared over CUDA IPC with every co-attached engine",
        "sglang/srt/model_executor/model_runner_components/weight_updater.py:159",
        "launch the rollout with --weight-cache-mode off",
        "so p2p's in-place writes would change that master copy under the daemon and every other attached engine",
    ),
    DerivedWeightCache(
        "enable_dsa_fused_indexer",
        "server_arg",
        lambda value: value is True or (isinstance(value, str) and _on(value)),
        "the gfx950 fused DSA indexer keeps one-time copies of k_norm (and of [wk ; weights_proj])",
        "sglang/srt/layers/attention/dsa/dsa_indexer.py:504",
        "launch the rollout with --no-enable-dsa-fused-indexer",
    ),
)

ENV_CACHES: tuple[DerivedWeightCache, ...] = (
    DerivedWeightCache(
        "SGLANG_OPT_BF16_FP32_GEMM_ALGO",
        "env",
        lambda value: str(value).strip().lower() == "hpc",
        "the HPC-Ops bf16xfp32 GEMM caches the fp32 weight split",
        "sglang/srt/model_executor/model_runner_components/weight_updater.py:76-84",
        "unset SGLANG_OPT_BF16_FP32_GEMM_ALGO (or set it to cublas) where the rollout runs",
    ),
    DerivedWeightCache(
        "SGLANG_OPT_SM120_NVFP4_PHASE_LAYOUT",
        "env",
        _on,
        "the NVFP4 phase layout keeps a re-laid-out copy of the expert weights",
        "sglang/srt/models/nemotron_h.py:1167",
        "unset SGLANG_OPT_SM120_NVFP4_PHASE_LAYOUT where the rollout runs",
    ),
)


def server_arg_cache_problems(server_args: Mapping[str, Any]) -> list[str]:
    """Each server arg (engine_kwargs.sglang before launch, /server_info at connect) that turns a cache on."""
    return [p for c in SERVER_ARG_CACHES if (p := c.problem(server_args.get(c.setting))) is not None]


def env_cache_problems(environ: Mapping[str, str]) -> list[str]:
    """Each environment variable of the server process that turns a cache on (call it where the server runs:
    SGLang's scheduler processes inherit that environment). SGLang's defaults for these variables are all off."""
    return [p for c in ENV_CACHES if (p := c.problem(environ.get(c.setting))) is not None]


# Model classes that turn the HPC-Ops bf16xfp32 GEMM cache on by themselves, whatever the environment says, when
# the `hpc` package is importable on a Hopper GPU (sglang/srt/models/longcat_flash.py:222,
# `mark_hpc_bf16xfp32_gemm_enabled`).
HPC_GEMM_MODELS = ("LongcatFlashForCausalLM",)
HPC_PACKAGE = "hpc"


def hpc_gemm_problem(architectures: Sequence[str], hpc_installed: bool) -> str | None:
    """Where the server runs: a model that caches HPC-Ops weight splits on its own, with HPC-Ops installed."""
    hit = sorted(set(architectures) & set(HPC_GEMM_MODELS))
    if not hit or not hpc_installed:
        return None
    return (
        f"{hit[0]} with HPC-Ops (the `{HPC_PACKAGE}` package) installed: SGLang routes its router GEMM to the "
        "HPC-Ops bf16xfp32 kernel, which caches the fp32 weight split that p2p's in-place writes never refresh, so "
        "the rollout would keep serving the old router weights (SGLang refuses its own update APIs here, "
        "sglang/srt/model_executor/model_runner_components/weight_updater.py:76-84). Fix: uninstall HPC-Ops from "
        "the rollout's environment"
    )


# SGLang's other derived-weight caches (sources that set `_derived_weight_cache_error` or that
# `_unsupported_derived_weight_cache_error` inspects), each with the p2p refusal that already keeps it off.
REFUSED_ELSEWHERE: dict[str, str] = {
    "sglang/srt/layers/quantization/fp8.py": (
        "Hopper FP8->BF16 weight cache: only [32, 32] UE8M0 block FP8, and p2p reproduces 128x128 block FP8 only "
        "(quant/block_fp8.py BLOCK, replica/fp8.py quantization_problems)"
    ),
    "sglang/srt/models/qwen3_5.py": (
        "packed FP8 GDN input projection: built only with SGLANG_USE_AITER on ROCm, which p2p refuses where the "
        "rollout launches (rollout/post_processing.py)"
    ),
    "sglang/srt/models/deepseek_v4.py": (
        "compensated mHC weight splits (SGLANG_OPT_DEEPGEMM_HC_PRENORM): DeepseekV4ForCausalLM only, which p2p "
        "refuses (replica/model_class.py UNSUPPORTED_CLASSES)"
    ),
}
