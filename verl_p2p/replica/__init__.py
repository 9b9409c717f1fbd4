"""Trainer-side replica of one SGLang rollout rank: HF tensors -> that rank's exact parameter bytes.

`RankReplica.build(hf_config, server_args, layout, hf_specs, cache=None)` is the entry point (see `stream.py`); it
is the reference executor (SGLang's loader per parameter). `CompiledReplica` (`compiled.py`) runs the same plan as
batched torch copies. `PlanCache` keeps captured write plans on disk (`plan_cache.py`). SGLang is imported lazily,
when a replica first calls it.
"""

from verl_p2p.replica.compiled import CompiledPlanMismatchError, CompiledReplica, make_executor
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
    TESTED_SGLANG_RANGE,
    RankContext,
    UnsupportedSGLangVersionError,
    rank_context,
)
from verl_p2p.replica.stream import CompletenessStager, RankReplica, ReplicaLoadError, replica_key

__all__ = [
    "TESTED_SGLANG_RANGE",
    "CompiledPlanMismatchError",
    "CompiledReplica",
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
    "make_executor",
    "check_syncable",
    "default_plan_cache_dir",
    "rank_context",
    "replica_key",
]
