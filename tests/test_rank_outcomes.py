"""How the driver classifies a trainer rank's push outcome (backend/outcomes.py), from the exception as Ray
delivers it: pickled inside Ray's RayTaskError by Ray's cloudpickle (a rank's PushError keeps its cause on the way,
errors.P2PError.__reduce__), or Ray's own ActorDiedError / ActorUnavailableError, or the driver's LateError.

The go/no-go case runs the real `agree_to_export` in a two-rank gloo world: the rank that refused is planned
around, the rank that merely agreed is healthy (it wrote nothing, so all its targets are unknown).
"""

from __future__ import annotations

import ray.cloudpickle
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from verl_p2p.backend.outcomes import (
    Kind,
    RankOutcome,
    classify,
    not_waited_for,
    repush_exclusions,
    unreachable_ranks,
)
from verl_p2p.backend.topology import SourceMeta
from verl_p2p.errors import LateError, P2PError, PushError, TransferError, unknown_targets_of
from verl_p2p.planning.targets import TargetRank
from verl_p2p.sandbox.cpu_megatron import run_group
from verl_p2p.transfer.writer import _STILL_IN_FLIGHT, TargetFailure, push_error

A, B = TargetRank(0, 0), TargetRank(0, 1)


def delivered(error: BaseException, assigned=(A, B)) -> BaseException:
    """`error` raised in a trainer rank's push as the driver receives it: wrapped in the PushError the rank reports
    (its unknown targets: those `error` names, else every one it was assigned), pickled inside RayTaskError."""
    named = unknown_targets_of(error)  # as the rank's engine reports them (P2PCheckpointEngine._unknown_after)
    wrapper = PushError("p2p push to version 2 failed on trainer rank 0", unknown_targets=named or assigned)
    wrapper.__cause__ = error
    task = RayTaskError("update_weights", "Traceback (stand-in)", wrapper, "ray::Worker", 1, "127.0.0.1")
    return ray.cloudpickle.loads(ray.cloudpickle.dumps(task)).as_instanceof_cause()


def test_a_rank_whose_error_names_its_targets_is_healthy_and_one_naming_none_is_planned_around():
    timed_out = classify(0, delivered(push_error([TargetFailure(A, "s", "write timed out after 2 s")])), (A, B))
    assert timed_out.kind is Kind.TARGETS_FAILED and not timed_out.planned_around
    assert timed_out.unknown == {A} and timed_out.busy == frozenset()
    local = classify(0, delivered(P2PError("p2p trainer rank has no plan")), (A, B))
    assert local.kind is Kind.FAILED and local.planned_around and not local.gone
    assert local.unknown == {A, B}  # it named none: every target of its assignment


def test_a_write_still_in_flight_is_busy_and_named_through_ray():
    refused = push_error([TargetFailure(A, "s", _STILL_IN_FLIGHT), TargetFailure(B, "s", "write timed out")])
    outcome = classify(3, delivered(refused), (A, B))
    assert outcome.kind is Kind.TARGETS_FAILED and outcome.unknown == {A, B}
    assert outcome.busy == {A}  # only the refused one: B's call timed out in this push


def test_dead_and_late_ranks():
    died = classify(1, ActorDiedError(), (A,))
    assert died.kind is Kind.DIED and died.gone and died.busy == frozenset() and died.unknown == {A}
    for late in (LateError("trainer rank 1 did not answer within 6 s"), ActorUnavailableError("unreachable", None)):
        outcome = classify(1, late, (A,))
        assert outcome.kind is Kind.LATE and outcome.gone and outcome.busy == {A}, late  # its call may still land


def test_only_the_refusing_rank_of_an_aborted_export_group_is_planned_around():
    by_rank = dict(enumerate(run_group(refuse_on_rank_1, 2, timeout_s=120)))
    stopped = classify(0, ray.cloudpickle.loads(by_rank[0]), (A,))
    refused = classify(1, ray.cloudpickle.loads(by_rank[1]), (B,))
    assert stopped.kind is Kind.STOPPED and not stopped.planned_around and stopped.unknown == {A}
    assert refused.kind is Kind.FAILED and refused.planned_around and refused.unknown == {B}


def test_a_refusal_naming_one_target_leaves_every_target_of_the_rank_unknown():
    """The go/no-go stopped the export before any byte moved: a refusing rank whose own error names one target
    (what its PushError reports) still wrote none of its others, so all of them are unknown (else they would be
    versioned and resumed with the old weights)."""
    from verl_p2p.trainer.senders import agree_to_export

    try:
        agree_to_export(0, None, push_error([TargetFailure(A, "s", "published size differs")]))
    except Exception as exc:  # noqa: BLE001 - the rank's go/no-go refusal
        refused = exc
    outcome = classify(0, delivered(refused), (A, B))
    assert outcome.kind is Kind.TARGETS_FAILED and outcome.unknown == {A, B}


def refuse_on_rank_1(rank: int, world: int, port: int) -> bytes:
    """One rank of a gloo world: the real go/no-go over both ranks, rank 1 refusing (a plan it cannot apply);
    returns the error as the driver receives it (the rank's PushError around it, pickled inside RayTaskError)."""
    import datetime

    import torch.distributed as dist

    from verl_p2p.trainer.senders import agree_to_export

    address, limit = f"tcp://127.0.0.1:{port}", datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world, timeout=limit)
    try:
        agree_to_export(rank, [0, 1], P2PError("replica layout not reproducible") if rank == 1 else None)
    except Exception as exc:  # noqa: BLE001 - what the rank reports
        wrapper = PushError(f"p2p push failed on trainer rank {rank}", unknown_targets=[(A, B)[rank]])
        wrapper.__cause__ = exc
        task = RayTaskError("update_weights", "Traceback (stand-in)", wrapper, "ray::Worker", 1, "127.0.0.1")
        return ray.cloudpickle.dumps(task.as_instanceof_cause())
    finally:
        dist.destroy_process_group()
    raise AssertionError("the go/no-go let both ranks export")


def test_a_re_push_prefers_other_senders_only_where_the_stage_has_one():
    # stage 0: ranks 0, 1; stage 1: ranks 2, 3; no export collective between ranks (PP-local, no TP)
    sources = [SourceMeta(r, r // 2, pp_size=2, export_peers=(r,)) for r in range(4)]

    def outcome(rank, kind):
        return RankOutcome(rank, kind, TransferError("x"))

    one_failed = {0: outcome(0, Kind.TARGETS_FAILED), 2: outcome(2, Kind.TARGETS_FAILED)}
    assert repush_exclusions(sources, one_failed) == {0, 2}  # ranks 1 and 3 can send their stages
    both = {r: outcome(r, Kind.TARGETS_FAILED) for r in (0, 1)}
    assert repush_exclusions(sources, both) == frozenset()  # stage 0 has no other sender: both stay eligible
    dead = {0: outcome(0, Kind.DIED), 1: outcome(1, Kind.TARGETS_FAILED)}
    assert repush_exclusions(sources, dead) == {0}  # the dead rank always; rank 1 is stage 0's only sender left


def test_the_export_peers_of_a_dead_rank_count_as_gone_for_the_re_push():
    """TP pairs (0, 1) and (2, 3) of one stage: rank 0 died, so rank 1 cannot export either (topology's blocked
    ranks) and is not waited for; ranks 2 and 3, whose writes failed, are the only senders left and stay eligible."""
    sources = [SourceMeta(r, 0, export_peers=(r - r % 2, r - r % 2 + 1)) for r in range(4)]
    outcomes = {
        0: RankOutcome(0, Kind.DIED),
        2: RankOutcome(2, Kind.TARGETS_FAILED),
        3: RankOutcome(3, Kind.TARGETS_FAILED),
    }
    assert unreachable_ranks(outcomes) == {0}
    assert not_waited_for(sources, outcomes) == {0, 1}
    assert repush_exclusions(sources, outcomes) == {0, 1}
