"""Trainer-side replica of one SGLang rollout rank: HF tensors -> that rank's exact parameter bytes.

`RankReplica.build(hf_config, server_args, layout, hf_specs)` is the entry point (see `stream.py`).
SGLang is imported lazily, when a replica is built.
"""

from verl_p2p.replica.plan import (
    ParamPlan,
    RecordedWrite,
    SourceView,
    WritePlan,
    WritePlanError,
    check_hf_coverage,
)
from verl_p2p.replica.rank_context import (
    TESTED_SGLANG_RANGE,
    RankContext,
    UnsupportedSGLangVersionError,
    rank_context,
)
from verl_p2p.replica.stream import CompletenessStager, RankReplica, ReplicaLoadError

__all__ = [
    "TESTED_SGLANG_RANGE",
    "CompletenessStager",
    "ParamPlan",
    "RankContext",
    "RankReplica",
    "RecordedWrite",
    "ReplicaLoadError",
    "SourceView",
    "UnsupportedSGLangVersionError",
    "WritePlan",
    "WritePlanError",
    "check_hf_coverage",
    "rank_context",
]
