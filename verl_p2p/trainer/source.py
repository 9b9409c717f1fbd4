"""A trainer rank's data plane, built on its first assignment and kept across syncs.

Once per process: the Megatron engine (from the owning verl worker) and the stage exporter; on the first
assignment with targets, the Mooncake transport and the two registered transfer buffers (idle ranks only run
the export's collectives and never allocate them). Per plan generation: one RankReplica per distinct target
layout (cached by key, so an unchanged layout is never rebuilt), its compiled programs (compiled and checked
against SGLang's loader at apply, not during the push) and a Writer for this rank's targets.
Every import of the heavy parts (Megatron-Bridge, SGLang model classes, Mooncake) happens here, lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from typing import Any

from verl_p2p.backend.topology import Assignment
from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PConfigError, P2PError
from verl_p2p.planning.shared_experts import check_replica_fusion, rollout_shared_expert_args

logger = logging.getLogger(__name__)


def _require(what: str, fix: str):
    """Import helper that turns an ImportError into a P2PError naming the package and the fix (chained)."""

    def wrap(exc: ImportError) -> P2PError:
        return P2PError(f"p2p trainer source needs {what} ({type(exc).__name__}: {exc}); {fix}")

    return wrap


_NO_BRIDGE = _require(
    "Megatron-Bridge and megatron-core", "install verl's Megatron stack (`pip install verl-p2p[megatron]`)"
)
_NO_SGLANG = _require(
    "SGLang's model classes", "install the rollout's SGLang release on the trainer (`pip install verl-p2p[sglang]`)"
)


class SourceSession:
    """Everything one trainer rank needs to export its stage and write it to its targets."""

    def __init__(self, config: P2PConfig, owner: Any, hostname: str | None = None, checkpoint_engine: Any = None):
        try:
            from verl_p2p.trainer.verl_engine import engine_exporter, find_owning_worker, find_training_engine
        except ImportError as exc:
            raise _NO_BRIDGE(exc) from exc
        if owner is None:  # the engine was not built inside a verl worker method: find the worker holding it
            owner = find_owning_worker(checkpoint_engine)
        if config.transport != "mooncake":
            raise P2PError(f"engine_kwargs.verl_p2p.transport={config.transport!r} is not wired yet; use 'mooncake'")
        self.config = config
        self.hostname = hostname
        self.engine = find_training_engine(owner)  # Megatron or FSDP: the export differs (trainer/exports.py)
        self.exporter = engine_exporter(self.engine, mode=config.export_mode)
        self.transport = None
        self.buffers = None
        self.inflight = None  # transfer.writer.InFlightCalls: every Writer's calls in flight (Writers come and go)
        self._save_hook = None
        self._replicas: dict[Hashable, Any] = {}
        self._executors: dict[Hashable, Any] = {}
        self._hf_specs = None
        self.assignment: Assignment | None = None
        self.writer = None
        self.targets: list[Any] = []
        self.stage = None
        self.share = None
        self.apply_error: Exception | None = None
        self.pushes = 0  # every push call, skipped ones too: names p2p's replacement gloo groups (senders.GROUPS)

    # ---- per generation ------------------------------------------------------------------------------------

    def apply(self, assignment: Assignment) -> None:
        """Take plan `assignment.generation`: build replicas for new layouts and a writer for these targets.

        A local failure (a layout the replica cannot reproduce, a rollout it must refuse) does not raise here:
        the peers of this rank's export group may already be on their way into the export. It is kept as
        `apply_error` and reported by the next `push` through the group's go/no-go, on every rank of the group.
        """
        from verl_p2p.trainer.push import PushTarget
        from verl_p2p.trainer.senders import ExportStage
        from verl_p2p.transfer.writer import Writer

        self.stage = ExportStage(
            rank=assignment.rank,
            pp_rank=assignment.pp_stage,
            pp_size=assignment.pp_size,
            ranks=assignment.stage_ranks,
            senders=assignment.stage_senders,
        )
        self.apply_error = None
        targets = []
        try:
            server_infos = {}  # per target: the rollout's server args with its shared-expert decisions
            for target in assignment.targets:  # refusals first: nothing is allocated for a plan that cannot run
                if target.engine in assignment.sessionless_engines:
                    self._refuse_without_sessions(
                        target, assignment.server_infos[target.engine], assignment.layouts[target]
                    )
                server_infos[target] = rollout_shared_expert_args(
                    self._rollout_hf_config(),
                    assignment.server_infos[target.engine],
                    {n: p.numel for n, p in assignment.rank_infos[target].params.items()},
                    f"rollout engine {target.engine} rank {target.rank}",
                )
            if assignment.targets:
                self._open_transport()
            for target in assignment.targets:
                replica = self._replica(server_infos[target], assignment.layouts[target])
                check_replica_fusion(
                    replica.plan.params,
                    assignment.rank_infos[target].params,
                    f"rollout engine {target.engine} rank {target.rank}",
                )
                part = assignment.parts.get(target, (0, 1))
                names = assignment.part_names.get(target)
                targets.append(PushTarget(target, self._executor(replica), assignment.rank_infos[target], part, names))
            self._prepare_executors(targets)
            if assignment.warm_up:  # never inside the pause (a re-push's plan): it would only delay the writes
                self._open_connections(targets)
        except Exception as exc:  # reported at push, by the go/no-go (see the docstring)
            self.apply_error, targets = exc, []
            logger.error(
                "p2p trainer rank %d cannot take plan generation %d: %s: %s",
                assignment.rank,
                assignment.generation,
                type(exc).__name__,
                exc,
                exc_info=logger.isEnabledFor(logging.DEBUG) or None,
            )
        if self.writer is not None:
            self.writer.close()
        self.writer = (
            Writer(
                self.transport,
                dict(assignment.rank_infos),
                timeout_s=self.config.p2p_transfer_timeout,
                num_workers=self.config.p2p_transfer_num_workers,
                inflight=self._inflight_calls(),
            )
            if targets
            else None
        )
        self.targets, self.assignment = targets, assignment
        try:  # a collective over the PP group: every rank reaches it (a rank cut off from the export skips it)
            self.share = self._stage_share(assignment) if assignment.export else None
        except Exception as exc:
            self.share = None
            self.apply_error = self.apply_error or exc

    def _prepare_executors(self, targets: list[Any]) -> None:
        """Compile every program this generation's push runs and (`verify_first_push`) check each against SGLang's
        loader on synthetic tensors into scratch memory, now: `apply` runs before the rollout is paused (the
        manager path), so the push holds the rollout only for its writes."""
        executors = {id(t.replica): t.replica for t in targets}.values()
        for executor in executors:
            if hasattr(executor, "prepare_push"):
                executor.prepare_push(
                    self.buffers.slot_bytes, verify=self.config.verify_first_push, device=_hf_device()
                )
        _warm_fp8_quantizer(executors)

    def _inflight_calls(self) -> Any:
        if self.inflight is None:
            from verl_p2p.transfer.writer import InFlightCalls

            self.inflight = InFlightCalls()
        return self.inflight

    def _open_connections(self, targets: list[Any]) -> None:
        """Open the Mooncake segment and connection of every target now, with a read of a few bytes of one of its
        parameters into the buffers' scratch, never a slot (a read changes nothing on the rollout, so it may run
        while it generates): the first push does not pay the handshakes inside the pause. A session with a write
        still in flight is skipped (the read would block behind it). A failed read retires the scratch (it may
        still land) and is logged; the push then reports the target it cannot reach."""
        from verl_p2p.transfer.buffers import SCRATCH_BYTES

        read = getattr(self.transport, "read", None)
        if read is None or self.buffers is None:
            return
        for t in targets:
            param = next((p for p in t.remote.params.values() if p.nbytes > 0), None)
            if param is None or self._inflight_calls().busy(t.remote.session_id):
                continue
            try:
                read(t.remote.session_id, [self.buffers.scratch()], [param.address], [min(param.nbytes, SCRATCH_BYTES)])
            except Exception as exc:  # noqa: BLE001 - the push names a target it cannot reach
                self.buffers.retire_scratch()
                logger.warning("p2p: could not open the connection to %s before the push: %s", t.target, exc)

    def _refuse_without_sessions(self, target: Any, server_info: Any, layout: Any) -> None:
        """A rollout without weight-update sessions never runs SGLang's post-load processing after our writes:
        refuse a model that needs it (its derived weights would keep the old values)."""
        try:
            from verl_p2p.replica.model_class import refuse_post_load_without_sessions
        except ImportError as exc:
            raise _NO_SGLANG(exc) from exc
        refuse_post_load_without_sessions(self._rollout_hf_config(), server_info, layout, target.engine)

    def _stage_share(self, assignment: Assignment) -> Any:
        """With PP > 1, the part of every rollout rank this stage writes (the HF names it exports). Every rank
        of the model computes it at the same generation: the first call exchanges names over the PP group."""
        if assignment.pp_size <= 1:
            return None
        from verl_p2p.trainer.push import StageShare

        ownership = self.exporter.ownership(exchange=True)
        return StageShare(owns=ownership.owns, writes_feedless=assignment.pp_stage == 0)

    def _open_transport(self) -> None:
        """The Mooncake endpoint and the registered transfer buffers, once (senders only)."""
        if self.transport is not None:
            return
        from verl_p2p.transfer.buffers import TransferBuffers
        from verl_p2p.transfer.mooncake import MooncakeTransport
        from verl_p2p.transfer.staging import choose_staging

        config = self.config
        self.transport = MooncakeTransport(
            self.hostname or _node_ip(), config.protocol, config.device_name, timeout_s=config.p2p_transfer_timeout
        )
        staging = choose_staging(config.staging, _hf_device(), protocol=config.protocol)
        logger.info("p2p transfer slots: %s", staging.reason)
        self.buffers = TransferBuffers(
            config.bucket_size_bytes, self.transport, device=staging.device, pin_memory=staging.pin_memory
        )
        if config.release_buffers_on_save:
            from verl_p2p.trainer.verl_engine import release_buffers_around_save

            self._save_hook = release_buffers_around_save(self.engine, self.buffers)

    def _replica(self, server_info, layout) -> Any:
        """The replica of one target, cached by the replica's own key (`replica_key`): engines that differ in
        any server arg SGLang is handed (not only the layout's) never share one."""
        try:
            from verl_p2p.replica import PlanCache, RankReplica, replica_key
        except ImportError as exc:
            raise _NO_SGLANG(exc) from exc
        hf_config = self._rollout_hf_config()  # the rollout's checkpoint (rollout_model_path: an FP8 copy)
        cache = PlanCache.from_option(self.config.plan_cache_dir)
        key = replica_key(hf_config, server_info, layout, self._specs(), cache)
        if key not in self._replicas:
            replica = RankReplica.build(hf_config, server_info, layout, self._specs(), cache=cache)
            if replica.key != key:
                raise P2PError(f"replica key {replica.key} differs from its expected {key}: report this")
            self._replicas[key] = replica
        return self._replicas[key]

    def _executor(self, replica) -> Any:
        """The executor pushing `replica`'s bytes (`executor` option), one per replica key: compiled copy
        programs (SGLang's loader for what cannot be compiled), or SGLang's loader for every parameter."""
        if replica.key not in self._executors:
            from verl_p2p.replica.compiled import make_executor

            self._executors[replica.key] = make_executor(replica, self.config.executor)
        return self._executors[replica.key]

    def _specs(self):
        if self._hf_specs is None:
            from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint

            self._hf_specs = hf_specs_from_checkpoint(
                self.config.rollout_model_path or self.engine.model_config.local_path
            )
        return self._hf_specs

    def _rollout_hf_config(self) -> Any:
        """The HF config of the checkpoint the rollout serves: `rollout_model_path`'s (FP8 rollouts), else the
        trainer's own."""
        path = self.config.rollout_model_path
        if not path:
            return self.engine.model_config.hf_config
        import json
        import os

        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise P2PConfigError(
                f"rollout_model_path={path!r} has no config.json: point it at the HF checkpoint directory the "
                "rollout was started from (readable on the trainer nodes)"
            )
        with open(config_file) as f:
            return json.load(f)

    # ---- per sync ------------------------------------------------------------------------------------------

    def stream(self, weights: Iterable | None = None) -> Iterable:
        """This sync's export; `weights`: verl's generator handed to `send_weights` (FSDP consumes it, once)."""
        from verl_p2p.trainer.senders import drive_export
        from verl_p2p.trainer.verl_engine import export_engine_stage

        return drive_export(self.stage, export_engine_stage(self.exporter, self.engine, weights=weights))

    def push(self, weights: Iterable | None = None) -> Any:
        """Export this stage and write it (sender) or run the export's collectives only (idle); PushMetrics or None.

        Go/no-go first: this rank's plan problems and every check possible before a byte moves (published
        sizes, ranges, dtypes) are agreed over the export group, so one rank's refusal makes every rank of
        the group raise instead of leaving them in the export's gathers. A failure while streaming drains the
        export to its end (the peers' collectives still match) before it is raised.
        """
        if self.assignment is None:
            raise P2PError("p2p trainer source has no plan yet: init_process_group must run before send_weights")
        self.pushes += 1
        if not self.assignment.export:  # a rank it exports with died or is late: the plan leaves it out
            logger.warning(
                "p2p trainer rank %d: plan generation %d leaves it out of the export (a rank it exports with died "
                "or is late); nothing to do",
                self.assignment.rank,
                self.assignment.generation,
            )
            return None
        from verl_p2p.trainer.exports import stream_digest
        from verl_p2p.trainer.senders import agree_to_export, drain

        error, checked = self.apply_error, None
        if error is None and self.targets:
            try:
                checked = self._check()
            except Exception as exc:  # agreed below: every rank of the group raises it
                error = exc
        digest, error = stream_digest(self.exporter, error)  # FSDP: every rank must stream the same tensors
        deadline = self.config.p2p_push_deadline_s
        agree_to_export(self.assignment.rank, self.export_ranks(), error, digest, timeout_s=deadline, epoch=self.pushes)
        stream = self.stream(weights)
        try:
            if not self.targets:
                for _ in stream:  # drive_export drains for non-senders: nothing comes out
                    pass
                return None
            from verl_p2p.trainer.push import push

            return push(
                stream,
                self.targets,
                self.buffers,
                self.writer,
                share=self.share,
                checked=checked,
                allowed_unused=self.config.unused_hf_tensors_allowed,
            )
        except Exception as exc:
            drain(stream, exc)
            raise

    def export_ranks(self) -> tuple[int, ...] | None:
        """The ranks this rank's export runs collectives with: its stage (PP-local), or every rank (None: the
        fallback's full export crosses stages)."""
        return self.stage.ranks if getattr(self.exporter, "mode", None) == "pp_local" else None

    def _check(self) -> Any:
        """Everything checkable before the first write (see trainer.push.check_push); raises, writes nothing."""
        from verl_p2p.trainer.exports import check_stream
        from verl_p2p.trainer.push import check_push

        fp8 = getattr(getattr(self.exporter, "bridge", None), "export_weight_dtype", None) == "fp8"
        groups = check_push(
            self.targets,
            self.writer,
            self.share,
            streams_fp8=fp8,
            unwritten_allowed=self.config.unwritten_params_allowed,
        )
        check_stream(self.exporter, groups, self.config.unused_hf_tensors_allowed)  # FSDP: names before a write
        return groups

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._save_hook is not None:
            self._save_hook.remove()
        if self.buffers is not None:
            self.buffers.release()


def _warm_fp8_quantizer(executors: Any) -> None:
    """FP8 rollouts: compile the GPU quantizer for the shapes the push quantizes, now, before the pause (the
    first sync of a trainer process paid its JIT inside the pause: 0.54 s of a 0.70 s pause on the H200)."""
    from verl_p2p.trainer.fp8_stream import plan_fp8_targets

    shapes = set()
    for executor in executors:
        planned = getattr(executor.plan, "hf_specs", None) or {}
        shapes.update(tuple(planned[name][0]) for name in plan_fp8_targets([executor.plan]))
    if shapes:
        import torch

        from verl_p2p.quant.block_fp8 import warm_up

        warm_up(shapes, (torch.bfloat16, torch.float32), _hf_device())


def _hf_device() -> Any:
    """Where the export yields HF tensors: this rank's GPU on a CUDA host (verl's Megatron engine), else CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]")
