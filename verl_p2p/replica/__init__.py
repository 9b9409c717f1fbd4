"""Trainer-side replica of one SGLang rollout rank: HF tensors -> that rank's exact parameter bytes.

`RankReplica.build(hf_config, server_args, layout, hf_specs, cache=None)` is the entry point (see `stream.py`);
`PlanCache` keeps captured write plans on disk (`plan_cache.py`).
SGLang is imported lazily, when a replica is built.
"""

from verl_p2p.replica.plan import (
    ParamPlan,
    RecordedWrite,
    SourceView,
    WritePlan,
    WritePlanError,
    check_hf_coverage,
    check_syncable,
)
from verl_p2p.replica.plan_cache import PlanCache, PlanKey, default_plan_cache_dir
from verl_p2p.replica.rank_context import (
    SUPPORTED_SGLANG_VERSIONS,
    RankContext,
    UnsupportedSGLangVersionError,
    rank_context,
)
from verl_p2p.replica.stream import CompletenessStager, RankReplica, ReplicaLoadError

__all__ = [
    "SUPPORTED_SGLANG_VERSIONS",
    "CompletenessStager",
    "ParamPlan",
    "PlanCache",
    "PlanKey",
    "RankContext",
    "RankReplica",
    "RecordedWrite",
    "ReplicaLoadError",
    "SourceView",
    "UnsupportedSGLangVersionError",
    "WritePlan",
    "WritePlanError",
    "check_hf_coverage",
    "check_syncable",
    "default_plan_cache_dir",
    "rank_context",
]
