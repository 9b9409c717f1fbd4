"""Defects a real SGLang GPU server under verl showed, which no CPU stand-in had shown (docs/protocol.md section 7)."""

from __future__ import annotations

import dataclasses
import pickle
import types

import pytest

from verl_p2p.errors import P2PError, PushError, TransferError
from verl_p2p.planning.targets import TargetRank
from verl_p2p.rollout.client import RolloutCallError
from verl_p2p.rollout.launch import repair_scheduler_info
from verl_p2p.rollout.lifecycle import ReplicaFailure, StaleReplica, SyncError
from verl_p2p.trainer.senders import ExportAbortedError


def test_server_info_answers_again_after_the_scheduler_info_is_repaired():
    # verl 0.9.1 stores the PortArgs SGLang 0.5.10+ returns third as the scheduler info; /server_info merges that
    # into its answer ({**asdict(server_args), **scheduler_info, ...}) and answered HTTP 500 on the H200
    from sglang.srt.server_args import PortArgs

    state = types.SimpleNamespace(scheduler_info=object.__new__(PortArgs))
    with pytest.raises(TypeError, match="not a mapping"):
        _ = {"tp_size": 1, **state.scheduler_info}
    assert repair_scheduler_info(state) is True
    assert {"tp_size": 1, **state.scheduler_info} == {"tp_size": 1}
    kept = types.SimpleNamespace(scheduler_info={"max_req_input_len": 8})  # a server SGLang launched itself
    assert repair_scheduler_info(kept) is False and kept.scheduler_info == {"max_req_input_len": 8}
    assert repair_scheduler_info(None) is False


@pytest.mark.parametrize(
    "error",
    [
        RolloutCallError("http://h:1", "GET", "/server_info", 500, "Internal Server Error", "is the server up?"),
        TransferError("write failed", unknown_targets=[TargetRank(0, 1)]),
        PushError("push failed", unknown_targets=[TargetRank(1, 0)]),
        ExportAbortedError([0, 1], {1: "RemoteMismatchError: sizes differ"}),
        SyncError(
            "3",
            [ReplicaFailure("push", None, None, TransferError("x"))],
            stale=[StaleReplica(0, "http://h:1", "rank(s) [0] not fully written")],
        ),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_cross_a_process_boundary_whole(error):
    # Ray pickles a worker's exception to the driver; one whose constructor takes other arguments than its message
    # arrived as "Failed to deserialize exception" on the H200 run, and the cause was lost
    assert isinstance(error, P2PError)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    fields = {k: v for k, v in vars(error).items() if not k.startswith("_")}
    assert {k: getattr(again, k) for k in fields}.keys() == fields.keys()
    for key, value in fields.items():
        if dataclasses.is_dataclass(value) or isinstance(value, (str, int, frozenset, tuple, dict, type(None))):
            assert getattr(again, key) == value, key
