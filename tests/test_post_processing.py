"""Review defect 4: SGLang's post-load processing is allowed by platform (an allow-list), not refused case by
case: ROCm with AITER (MoE shuffle), the CPU engine with AMX (packing) and unknown devices are refused at launch
naming the processing; at connect only a CUDA device passes (the rest cannot be seen from /server_info)."""

from __future__ import annotations

import pytest

from verl_p2p.errors import P2PConfigError, UnsupportedLayoutError
from verl_p2p.rollout import launch
from verl_p2p.rollout.launch import MEMORY_SAVER, SEED_FLAG
from verl_p2p.rollout.post_processing import Platform, check_platform, local_platform, platform_problem


@pytest.mark.parametrize(
    "platform",
    [Platform("cuda"), Platform("cuda", hip=True), Platform("cpu")],
    ids=["nvidia", "rocm-no-aiter", "cpu-no-amx"],
)
def test_platforms_on_the_allow_list_pass(platform):
    assert platform_problem(platform) is None
    check_platform(platform, "rollout server on h1")


@pytest.mark.parametrize(
    "platform, named",
    [
        (Platform("cuda", hip=True, aiter=True), r"ROCm with SGLANG_USE_AITER on: UnquantizedFusedMoEMethod.*16x16"),
        (Platform("cpu", cpu_amx=True), r"SGLang's CPU engine on a host with AMX: .* AMX-pack"),
        (Platform("npu"), r"device 'npu': its post-load weight processing is not on p2p's allow-list"),
        (Platform("xpu"), r"device 'xpu'"),
    ],
    ids=["rocm-aiter", "cpu-amx", "npu", "xpu"],
)
def test_other_platforms_are_refused_naming_the_processing(platform, named):
    with pytest.raises(P2PConfigError, match=r"^rollout server on h1: " + named):
        check_platform(platform, "rollout server on h1")


def test_local_platform_reads_aiter_from_the_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_AITER", "1")
    assert local_platform("cuda").aiter
    monkeypatch.delenv("SGLANG_USE_AITER")
    assert not local_platform("cuda").aiter and local_platform("npu").device == "npu"


def test_connect_refuses_a_device_whose_post_processing_it_cannot_see():
    launch.check_live_server_args({SEED_FLAG: True, "device": "cuda"}, engine=0, url="http://h:1")
    launch.check_live_server_args({SEED_FLAG: True}, engine=0, url="http://h:1")  # no device named: launch checked
    with pytest.raises(UnsupportedLayoutError, match=r"rollout engine 3 \(http://h:1\): device='cpu'"):
        launch.check_live_server_args(
            {SEED_FLAG: True, MEMORY_SAVER: False, "device": "cpu"}, engine=3, url="http://h:1"
        )
