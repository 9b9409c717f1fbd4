"""Megatron-Bridge's own bridges build the tiny DeepSeek-V2/V3 and GLM-4.5/4.7-Flash models without TE, and
their HF export is the checkpoint, tensor by tensor.

`build_tiny_megatron` is the trainer of the demo, the tests and the e2e harness. These families need more than
the Qwen models (MLA, dense first layers, shared experts; see `verl_p2p/sandbox/cpu_megatron.py`). Each model
is built in one gloo group (TP2/EP2, so MLA's and the experts' TP/EP gathers run for real) from an id-encoded
checkpoint (every element a distinct integer): the bridge's full export and the PP-local export p2p streams
from must both hold exactly the checkpoint's tensor names, each bit-equal in dtype, shape and bytes. Names of
MTP layers (`model.layers.<n>` with n >= num_hidden_layers) are left out on both sides, as SGLang's main model
skips them; the tiny checkpoints have none, while GLM-4.7-Flash's bridge exports its MTP embedding aliases.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from verl_p2p.sandbox.cpu_megatron import Parallel, run_group
from verl_p2p.sandbox.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.slow

ARCHS = ("deepseek_v3", "deepseek_v2", "glm4_moe", "glm4_moe_lite")
PAR = Parallel(tp=2, ep=2, etp=1)


def _is_mtp(name: str, num_hidden_layers: int) -> bool:
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer.group(1)) >= num_hidden_layers


def _compare(got: dict, want: dict) -> dict[str, list[str]]:
    import torch

    return {
        "missing": sorted(set(want) - set(got)),
        "extra": sorted(set(got) - set(want)),
        "differing": sorted(
            n
            for n in set(got) & set(want)
            if got[n].dtype != want[n].dtype or got[n].shape != want[n].shape or not torch.equal(got[n], want[n])
        ),
    }


def _rank(rank: int, world: int, port: int, dirs: dict[str, str]) -> dict:
    """Per rank: build each model, export both ways, compare with the checkpoint (names and findings only)."""
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch
    from safetensors.torch import load_file

    from verl_p2p.sandbox.cpu_megatron import build_tiny_megatron, init_distributed
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.trainer.export import StageExporter

    install_cpu_stubs()
    init_distributed(rank, world, port)
    out = {}
    for arch, hf_dir in dirs.items():
        layers = json.loads((Path(hf_dir) / "config.json").read_text())["num_hidden_layers"]
        checkpoint = load_file(str(Path(hf_dir) / "model.safetensors"))
        modules, bridge = build_tiny_megatron(hf_dir, PAR)
        full = bridge.export_hf_weights(modules, cpu=True, show_progress=False, merge_adapter_weights=False)
        full = {n: t.detach().clone() for n, t in full}
        exporter = StageExporter(modules, bridge)
        local = {n: t.detach().clone() for n, t in exporter.export(cpu=True)}
        checkpoint_names = sorted(checkpoint)
        out[arch] = {
            "mtp_exported": sorted(n for n in full if _is_mtp(n, layers)),
            "mtp_in_checkpoint": [n for n in checkpoint_names if _is_mtp(n, layers)],
            "tensors": len(checkpoint),
            "export_mode": exporter.mode,
            "full": _compare({n: t for n, t in full.items() if not _is_mtp(n, layers)}, checkpoint),
            "pp_local": _compare({n: t for n, t in local.items() if not _is_mtp(n, layers)}, checkpoint),
        }
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("bridge-models")
    dirs = {arch: str(write_tiny_checkpoint(root / arch, arch, id_encoded=True)) for arch in ARCHS}
    return run_group(_rank, 2, dirs, timeout_s=400)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_is_the_checkpoint_tensor_by_tensor(reports, arch):
    for rank, report in enumerate(reports):
        found = report[arch]
        assert found["mtp_in_checkpoint"] == []  # the tiny checkpoint leaves MTP out: nothing of it is compared
        assert found["tensors"] > 40
        for path in ("full", "pp_local"):
            assert found[path] == {"missing": [], "extra": [], "differing": []}, (arch, rank, path, found[path])
        assert found["export_mode"] == "pp_local"


def test_what_the_comparison_leaves_out_is_mtp_aliases_only(reports):
    """DeepSeek's and GLM-4.5's bridges skip MTP tensors the checkpoint lacks; GLM-4.7-Flash's re-adds its MTP
    layer's embedding and head aliases on export (copies of model.embed_tokens / lm_head)."""
    aliases = ["model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"]
    for report in reports:
        assert {arch: report[arch]["mtp_exported"] for arch in ARCHS} == {
            "deepseek_v3": [],
            "deepseek_v2": [],
            "glm4_moe": [],
            "glm4_moe_lite": aliases,
        }
