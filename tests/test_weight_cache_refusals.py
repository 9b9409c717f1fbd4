"""SGLang's derived-weight caches (finding 1) and LoRA (finding 24) are refused before launch and at connect, naming
the setting and the fix; the list of caches is checked against the installed SGLang sources it cites."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.compose import OVERLAY, compose_config

from verl_p2p.backend.guards import MAIN_PPO, check_config, config_problems
from verl_p2p.errors import P2PConfigError, QuantizationError, UnsupportedLayoutError
from verl_p2p.planning.layout import check_reproducible, layout_from_server_args
from verl_p2p.planning.weight_caches import ENV_CACHES, REFUSED_ELSEWHERE, SERVER_ARG_CACHES
from verl_p2p.replica.fp8 import Fp8Platform
from verl_p2p.replica.rank_context import preflight
from verl_p2p.rollout import launch
from verl_p2p.rollout.post_processing import Platform

MAIN = "verl.trainer.main_ppo"
SGLANG = "actor_rollout_ref.rollout.engine_kwargs.sglang."
ROOT = Path(__file__).resolve().parents[1]
RELEASES = {v: ROOT / ".venv" / f"sglang-{v}" / "sglang" for v in ("0.5.21", "0.5.23")}

# (server arg, a value that turns the cache on, words of the fix)
ACTIVE_ARGS = [
    ("enable_nvidia_megakernel", True, "without --enable-nvidia-megakernel"),
    ("enable_amd_monokernel", True, "without --enable-amd-monokernel"),
    ("enable_paged_experts", True, "without --enable-paged-experts"),
    ("weight_cache_mode", "daemon", "--weight-cache-mode off"),
    ("weight_cache_mode", "client", "--weight-cache-mode off"),
    ("enable_dsa_fused_indexer", True, "--no-enable-dsa-fused-indexer"),
]
# what SGLang reports for the same args when the caches are off (its defaults)
INACTIVE_ARGS = {
    "enable_nvidia_megakernel": False,
    "enable_amd_monokernel": False,
    "enable_paged_experts": False,
    "weight_cache_mode": "off",
    "enable_dsa_fused_indexer": None,
}


def main_ppo(*overrides: str):
    """A real verl config: verl's ppo_megatron_trainer with conf/p2p's overlay, in the trainer mode p2p syncs."""
    args = ["--config-name=ppo_megatron_trainer", *OVERLAY, "trainer.v1.trainer_mode=separate_async", *overrides]
    return compose_config(MAIN, args)


def _override(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("arg, value, fix", ACTIVE_ARGS)
def test_hydra_guard_refuses_a_derived_weight_cache_before_launch(arg, value, fix):
    cfg = main_ppo(f"+{SGLANG}{arg}={_override(value)}")
    with pytest.raises(P2PConfigError) as info:
        check_config(cfg, MAIN_PPO, guard=True)
    text = str(info.value)
    assert f"{SGLANG}{arg}={value!r}" in text and fix in text
    assert ("old weights" in text) != (arg == "weight_cache_mode")  # the daemon's copy is changed, not kept stale
    assert "every other attached engine" in text or arg != "weight_cache_mode"


def test_hydra_guard_refuses_a_cache_turned_on_through_rays_runtime_env():
    env = "ray_kwargs.ray_init.runtime_env.env_vars.SGLANG_OPT_BF16_FP32_GEMM_ALGO"
    (problem,) = config_problems(main_ppo(f"+{env}=hpc"), MAIN_PPO)
    assert problem.startswith(f"{env}='hpc': ") and "set it to cublas" in problem
    assert config_problems(main_ppo(f"+{env}=cublas"), MAIN_PPO) == []


def test_hydra_guard_accepts_the_caches_off():
    overrides = [f"+{SGLANG}{arg}={'null' if v is None else _override(v)}" for arg, v in INACTIVE_ARGS.items()]
    assert config_problems(main_ppo(*overrides), MAIN_PPO) == []


@pytest.mark.parametrize("arg, value, fix", ACTIVE_ARGS)
def test_live_server_args_with_a_derived_weight_cache_are_refused_at_connect(arg, value, fix):
    info = {launch.SEED_FLAG: True, "tp_size": 1, **INACTIVE_ARGS}
    launch.check_live_server_args(info, engine=0, url="http://h:1")
    with pytest.raises(UnsupportedLayoutError) as refused:
        launch.check_live_server_args({**info, arg: value}, engine=0, url="http://h:1")
    assert "rollout engine 0" in str(refused.value) and f"{arg}={value!r}" in str(refused.value)
    assert fix in str(refused.value)
    with pytest.raises(UnsupportedLayoutError, match=re.escape(fix)):
        check_reproducible({**info, arg: value})


def test_replica_preflight_refuses_a_derived_weight_cache():
    info = {"tp_size": 1, "version": "0.5.12", "enable_paged_experts": True}
    layout = layout_from_server_args({"tp_size": 1}, 0)
    with pytest.raises(UnsupportedLayoutError, match="--enable-paged-experts"):
        preflight(info, layout, {"architectures": ["Qwen3ForCausalLM"]}, "0.5.12")


def test_a_release_without_these_args_is_not_refused():
    """SGLang 0.5.12's /server_info has none of the fields: nothing to refuse."""
    check_reproducible({"tp_size": 2})


ACCEPTED = Platform(device="cuda")


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"SGLANG_OPT_BF16_FP32_GEMM_ALGO": "hpc"}, "SGLANG_OPT_BF16_FP32_GEMM_ALGO='hpc'"),
        ({"SGLANG_OPT_BF16_FP32_GEMM_ALGO": "HPC"}, "set it to cublas"),
        ({"SGLANG_OPT_SM120_NVFP4_PHASE_LAYOUT": "1"}, "unset SGLANG_OPT_SM120_NVFP4_PHASE_LAYOUT"),
    ],
)
def test_server_process_refuses_an_environment_that_turns_a_cache_on(env, needle):
    with pytest.raises(P2PConfigError, match=re.escape(needle)) as info:
        launch.check_server_process({}, None, "rollout server on h", environ=env, platform=ACCEPTED)
    assert str(info.value).startswith("rollout server on h: ")


def test_server_process_accepts_sglang_defaults():
    env = {"SGLANG_OPT_BF16_FP32_GEMM_ALGO": "cublas", "SGLANG_OPT_SM120_NVFP4_PHASE_LAYOUT": "0"}
    launch.check_server_process({}, None, "rollout server on h", environ=env, platform=ACCEPTED)
    launch.check_server_process({}, None, "rollout server on h", environ={}, platform=ACCEPTED)


def test_server_process_refuses_a_model_that_caches_hpc_gemm_splits_when_hpc_ops_is_installed():
    longcat = {"architectures": ["LongcatFlashForCausalLM"]}
    with pytest.raises(P2PConfigError, match="uninstall HPC-Ops"):
        launch.check_server_process({}, longcat, "rollout server on h", environ={}, platform=ACCEPTED, hpc=True)
    launch.check_server_process({}, longcat, "rollout server on h", environ={}, platform=ACCEPTED, hpc=False)
    qwen3 = {"architectures": ["Qwen3ForCausalLM"]}
    launch.check_server_process({}, qwen3, "rollout server on h", environ={}, platform=ACCEPTED, hpc=True)


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_the_models_that_turn_hpc_gemm_on_are_the_ones_listed(version):
    root = _release_sources(version)
    marking = {
        p.stem for p in (root / "srt" / "models").glob("*.py") if "mark_hpc_bf16xfp32_gemm_enabled()" in p.read_text()
    }
    assert marking == {"longcat_flash"}
    assert "class LongcatFlashForCausalLM(" in (root / "srt" / "models" / "longcat_flash.py").read_text()


# ---- FP8 platform, decided where the rollout runs (finding 6) ---------------------------------------------------

FP8_HF = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}


@pytest.mark.parametrize(
    "platform, needle",
    [(Fp8Platform(hip=False, scale_ue8m0=True), "Blackwell"), (Fp8Platform(hip=True, scale_ue8m0=False), "ROCm")],
)
def test_server_process_refuses_an_fp8_rollout_on_a_gpu_that_rewrites_fp8(platform, needle):
    """The rollout host's own facts (stand-ins for a Blackwell / ROCm GPU, which this host lacks) decide."""
    with pytest.raises(QuantizationError, match=f"rollout server on h: block-FP8 rollout on {needle}"):
        launch.check_server_process({}, FP8_HF, "rollout server on h", {}, ACCEPTED, fp8_platform=platform)
    # a bf16 checkpoint on the same GPU is not an FP8 rollout
    launch.check_server_process({}, {}, "rollout server on h", environ={}, platform=ACCEPTED, fp8_platform=platform)


def test_server_process_accepts_an_fp8_rollout_on_hopper():
    hopper = Fp8Platform(hip=False, scale_ue8m0=False)
    launch.check_server_process({}, FP8_HF, "h", environ={}, platform=ACCEPTED, fp8_platform=hopper)


# ---- LoRA (finding 24) -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora.rank=8"])
def test_lora_is_refused_before_launch_naming_lora_and_the_fix(override):
    cfg = main_ppo(override)
    with pytest.raises(P2PConfigError) as info:
        check_config(cfg, MAIN_PPO, guard=True)
    text = str(info.value)
    assert f"{override}: LoRA is on" in text
    assert "merge the adapter" in text and "drop checkpoint_engine.backend=verl_p2p" in text


def test_lora_off_is_accepted():
    assert config_problems(main_ppo("actor_rollout_ref.model.lora_rank=0"), MAIN_PPO) == []


# ---- the list against the SGLang sources it cites ------------------------------------------------------------


def _release_sources(version: str) -> Path:
    root = RELEASES[version]
    if not root.is_dir():
        pytest.skip(f"SGLang {version} sources are not installed under .venv (make setup installs them)")
    return root


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_every_derived_weight_cache_of_the_installed_sglang_is_refused(version):
    """Each place SGLang declares a cache its update APIs refuse is either a setting refused here or listed with
    the refusal that keeps it off: a new release that adds one fails here until it is classified."""
    root = _release_sources(version)
    ours = {cache.source.split(":")[0] for cache in SERVER_ARG_CACHES + ENV_CACHES}
    declared = set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if re.search(r"_derived_weight_cache_error = \(", text) or re.search(r"_hc_\w+_parts = split_", text):
            declared.add("sglang/" + str(path.relative_to(root)))
    assert declared, "no derived-weight cache found: the scan no longer matches SGLang's code"
    unclassified = declared - ours - set(REFUSED_ELSEWHERE)
    assert not unclassified, f"SGLang {version} caches p2p neither refuses nor explains: {sorted(unclassified)}"


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_each_setting_is_what_the_installed_sglang_calls_it(version):
    root = _release_sources(version)
    fields = "".join(p.read_text() for p in (root / "srt" / "arg_groups" / "fields").glob("*.py"))
    environ = (root / "srt" / "environ.py").read_text()
    updater = (root / "srt" / "model_executor" / "model_runner_components" / "weight_updater.py").read_text()
    assert "_unsupported_derived_weight_cache_error" in updater and "weight_cache_mode" in updater
    for cache in SERVER_ARG_CACHES:
        if version == "0.5.21" and cache.setting != "weight_cache_mode":
            assert f"    {cache.setting}: A[" not in fields  # added in 0.5.23: absent args are no-ops
            continue
        assert f"    {cache.setting}: A[" in fields, cache.setting
    for cache in ENV_CACHES:
        if cache.setting in environ:
            assert re.search(rf"    {cache.setting} = Env(Bool\(False\)|Str\(\"cublas\"\))", environ), cache.setting
