"""A trainer host without a GPU builds the replica of a CUDA rollout rank for every MLA class (review finding 21).

The rollout's `/server_info` says `device: cuda`. SGLang's MLA attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash)
builds its yarn rope with the device it asks SGLang for; on this CPU host SGLang's platform lookup raised "No
accelerator" and the first sync failed before a byte was written. Each test drives the real replica build
(`RankReplica.build` -> `plan_rank` -> `build_meta_model`, SGLang's own model classes and loaders) under one SGLang
release, in a process of its own, and compares the result with the replica built from server args saying `cpu`:
the same write plan, and the reference executor (SGLang's `load_weights`) writes the same bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.replica_harness import REPO, SGLANG_DIRS, version_env

pytestmark = pytest.mark.slow

# the MLA classes: tiny sandbox shapes, and Kimi-K2's published widths at two layers (its rope: yarn, factor 32)
MODELS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "kimi-k2")


def _available(version: str) -> bool:
    return SGLANG_DIRS[version] is None or SGLANG_DIRS[version].is_dir()


@pytest.mark.parametrize("version", ["0.5.12", "0.5.21", "0.5.23"])
def test_cuda_rollout_mla_replica_builds_on_a_cpu_host(version):
    if not _available(version):
        pytest.fail(f".venv/sglang-{version} is missing: run scripts/setup.sh")  # never a silent fallback
    code = f"import sys; sys.path.insert(0, 'tests'); import test_replica_cpu_host as t; t._build_all({version!r})"
    env = version_env(version)
    env["CUDA_VISIBLE_DEVICES"] = ""  # this host has no GPU; say so even where one is present
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=os.fspath(REPO)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"built {len(MODELS)} MLA classes under SGLang {version}" in proc.stdout


def _config(model: str) -> tuple[dict, dict, dict]:
    import torch

    from verl_p2p.planning.model_cards import model_card
    from verl_p2p.sandbox.tiny import hf_tensor_shapes, tiny_config_dict

    if model == "kimi-k2":
        cfg = model_card("kimi-k2", num_hidden_layers=2)  # layer 0 dense, layer 1 with 384 routed experts
        args = {"tp_size": 8, "ep_size": 8, "dtype": "bfloat16"}
        dtype = torch.bfloat16
    else:
        cfg = tiny_config_dict(model)
        args = {"tp_size": 2, "dtype": "float32"}
        dtype = torch.float32
    assert cfg["rope_scaling"]["type"] == "yarn", f"{model}: not the yarn rope that asks the device"
    return cfg, args, {n: (s, dtype) for n, s in hf_tensor_shapes(cfg)}


def _build_all(version: str) -> None:
    """The test's body, in a process of SGLang `version` (asserts raise there)."""
    import sglang
    import torch

    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs

    install_cpu_stubs()
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica import RankReplica

    assert sglang.__version__ == version and not torch.cuda.is_available()
    for model in MODELS:
        cfg, args, specs = _config(model)
        rank = args["tp_size"] - 1
        cuda_args, cpu_args = dict(args, device="cuda"), dict(args, device="cpu")
        layout = layout_from_server_args(cuda_args, rank)
        replica = RankReplica.build(cfg, cuda_args, layout, specs)  # what the sync path gets from /server_info
        reference = RankReplica.build(cfg, cpu_args, layout_from_server_args(cpu_args, rank), specs)
        assert replica.plan == reference.plan, f"{model}: the plan depends on the device answer"
        assert set(replica.plan.derived) >= {"model.layers.0.self_attn.w_kc", "model.layers.0.self_attn.w_vc"}
        if model == "kimi-k2":
            continue  # real widths: the plan is the proof; the bytes are checked at tiny shapes
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        p = replica.plan.params[name]
        feeds = {f: torch.randn(specs[f][0], generator=torch.Generator().manual_seed(1)) for f in p.feeds}
        got = torch.full((p.numel,), float("nan")).view(torch.uint8)
        want = torch.full((p.numel,), float("nan")).view(torch.uint8)
        replica.load(name, feeds, got)  # SGLang's own loader on the replica built from cuda server args
        reference.load(name, feeds, want)
        assert torch.equal(got, want), f"{model}: {name} bytes differ"
    print(f"built {len(MODELS)} MLA classes under SGLang {version}")
