"""check_weight_update_equal: prove the first sync wrote every rollout tensor bit for bit.

Before the first sync every replica snapshots its weights and then overwrites them with random values
(`reset_tensors`); after the first sync `compare` must pass on every replica, so a tensor the sync missed
shows up as a mismatch instead of silently keeping its checkpoint value. Only meaningful when the trainer's
initial weights are the rollout's checkpoint: a trainer resumed from a checkpoint skips it.

A compare belongs to the snapshot taken before it. A replica whose compare failed or timed out is re-armed by
the next sync (snapshot + reset again, then compare): SGLang drops a rank's snapshot once its compare passed
there (0.5.21 on), so comparing again against the first snapshot could never pass on those ranks, and a
timed-out compare may have passed on the server. A replica armed but not compared (its push failed) keeps its
snapshot, untouched by any compare, and is compared after the next sync. Meanwhile the lifecycle keeps it stale.
A re-armed compare passes when the sync rewrites the bytes the replica held before it (a sync retried at the
same step); after a training step it fails again, naming the replica (restart the rollout to leave the check).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PError
from verl_p2p.sglang_versions import CHECKER_QUANT_ERROR_SINCE, CHECKER_SKIP_LIST_SINCE, parse_release, release_text

logger = logging.getLogger(__name__)

_SKIP_LIST_ACTIONS = ("reset_tensors", "compare", "checksum")  # snapshot copies everything


class WeightCheckError(P2PError):
    """weights_checker failed (snapshot/reset/compare) on one or more replicas; `engines` names them."""

    def __init__(self, message: str, engines: Sequence[int] = ()):
        super().__init__(message)
        self.engines = frozenset(engines)


def checker_fields(config: P2PConfig, server_version: str | None, action: str) -> tuple[dict[str, Any], list[str]]:
    """The optional weights_checker fields this server accepts for `action`, and notes on what was dropped."""
    version = parse_release(server_version)
    shown = f"{server_version} predates" if version else f"of unknown version ({server_version!r}) may predate"
    fields: dict[str, Any] = {}
    dropped: list[str] = []
    if action == "compare" and config.check_weight_update_allow_quant_error:
        if version is not None and version >= CHECKER_QUANT_ERROR_SINCE:
            fields["allow_quant_error"] = True
        else:
            since = release_text(CHECKER_QUANT_ERROR_SINCE)
            dropped.append(f"allow_quant_error not sent: SGLang {shown} it (needs >= {since})")
    if action in _SKIP_LIST_ACTIONS and config.check_weight_update_skip_list:
        if version is not None and version >= CHECKER_SKIP_LIST_SINCE:
            fields["skip_tensor_list"] = list(config.check_weight_update_skip_list)
        else:
            since = release_text(CHECKER_SKIP_LIST_SINCE)
            dropped.append(f"skip_tensor_list not sent: SGLang {shown} it (needs >= {since})")
    return fields, dropped


class WeightUpdateChecker:
    """Arms (snapshot + reset) before the first sync; compares each armed replica after its sync; re-arms the
    replicas whose compare did not pass (see the module docstring) until every one passed."""

    def __init__(self, config: P2PConfig, resumed_from_checkpoint: bool = False):
        self.config = config
        self.state = "off"
        if config.check_weight_update_equal:
            self.state = "pending"
            if resumed_from_checkpoint:
                self.state = "skipped"
                logger.info(
                    "check_weight_update_equal skipped: the trainer resumed from a checkpoint, so its weights "
                    "differ from the rollout's initial checkpoint by design"
                )
        self._armed: dict[int, Any] = {}  # engine -> adapter snapshotted and reset, its compare not run yet
        self._rearm: set[int] = set()  # engines whose compare failed or timed out: snapshot + reset again
        self._noted: set[str] = set()

    @property
    def wants_arm(self) -> bool:
        return self.state == "pending" or (self.state == "armed" and bool(self._rearm))

    @property
    def wants_compare(self) -> bool:
        return self.state == "armed" and bool(self._armed)

    def arming(self, adapters: Sequence[Any]) -> list[Any]:
        """The replicas `arm(adapters)` snapshots and resets: all before the first sync, else those to re-arm."""
        if self.state == "pending":
            return list(adapters)
        return [a for a in adapters if a.engine in self._rearm] if self.state == "armed" else []

    async def arm(self, adapters: Sequence[Any]) -> None:
        """`snapshot` then `reset_tensors` on every replica `arming(adapters)` names (replicas in parallel)."""
        targets = self.arming(adapters)
        first = self.state == "pending"
        if first:
            self.state = "failed"  # a partial first arm leaves random weights: never snapshot those later
        when = "before the first sync" if first else "re-armed after a compare that did not pass"
        await self._each(targets, ("snapshot", "reset_tensors"), when)
        for adapter in targets:
            self._armed[adapter.engine] = adapter
            self._rearm.discard(adapter.engine)
        self.state = "armed"
        logger.info("check_weight_update_equal: snapshot + reset_tensors done on %d replica(s)", len(targets))

    async def compare(self, adapters: Sequence[Any]) -> None:
        """`compare` on every armed replica among `adapters`; raises WeightCheckError naming each mismatch.
        Those that passed are done; those that failed or timed out are re-armed by the next sync; armed ones
        not among `adapters` keep their snapshot and are compared next time."""
        targets = [a for a in adapters if a.engine in self._armed]
        failed = frozenset(a.engine for a in targets)  # until shown otherwise
        try:
            await self._each(targets, ("compare",), "after the first sync")
            failed = frozenset()
        except WeightCheckError as exc:
            failed = exc.engines or failed
            raise
        finally:
            for adapter in targets:
                self._armed.pop(adapter.engine, None)
                if adapter.engine in failed:
                    self._rearm.add(adapter.engine)
            self._settle()
        logger.info("check_weight_update_equal: compare passed on %d replica(s)", len(targets))

    def forget(self, engine: int) -> None:
        """A replica replaced by a new server (never snapshotted): nothing to compare it with."""
        self._armed.pop(engine, None)
        self._rearm.discard(engine)
        self._settle()

    def _settle(self) -> None:
        if self.state == "armed" and not self._armed and not self._rearm:
            self.state = "done"

    async def _each(self, adapters: Sequence[Any], actions: Sequence[str], when: str) -> None:
        async def one(adapter) -> list[str]:
            info = await adapter.server_info()
            notes: list[str] = []
            for action in actions:
                fields, dropped = checker_fields(self.config, info.get("version"), action)
                notes += dropped
                try:
                    await adapter.weights_checker(action, **fields)
                except Exception as exc:
                    why = getattr(exc, "message", None) or str(exc)
                    extra = f" [{'; '.join(notes)}]" if notes else ""
                    raise WeightCheckError(
                        f"check_weight_update_equal {when}: {action} failed on {adapter}: {why}{extra}",
                        engines=[adapter.engine],
                    ) from exc
            return notes

        results = await asyncio.gather(*(one(a) for a in adapters), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for note in sorted({n for notes in results if isinstance(notes, list) for n in notes} - self._noted):
            self._noted.add(note)
            logger.warning("check_weight_update_equal: %s", note)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            engines = [e for err in errors for e in getattr(err, "engines", ())]
            raise WeightCheckError("; ".join(str(e) for e in errors), engines=engines) from errors[0]
