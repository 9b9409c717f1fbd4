"""check_weight_update_equal: prove the first sync wrote every rollout tensor bit for bit.

Before the first sync every replica snapshots its weights and then overwrites them with random values
(`reset_tensors`); after the first sync `compare` must pass on every replica, so a tensor the sync missed
shows up as a mismatch instead of silently keeping its checkpoint value. Only meaningful when the trainer's
initial weights are the rollout's checkpoint: a trainer resumed from a checkpoint skips it. A replica whose
compare failed (or that was not compared: its push failed) stays armed and is compared again after every later
sync until it passes; the lifecycle keeps it stale meanwhile, so a wrong write is never forgotten.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from packaging.version import InvalidVersion, Version

from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PError

logger = logging.getLogger(__name__)

ALLOW_QUANT_ERROR_SINCE = Version("0.5.15")
SKIP_TENSOR_LIST_SINCE = Version("0.5.21")  # also `selector`
_SKIP_LIST_ACTIONS = ("reset_tensors", "compare", "checksum")  # snapshot copies everything


class WeightCheckError(P2PError):
    """weights_checker failed (snapshot/reset/compare) on one or more replicas; `engines` names them."""

    def __init__(self, message: str, engines: Sequence[int] = ()):
        super().__init__(message)
        self.engines = frozenset(engines)


def parse_version(text: str | None) -> Version | None:
    try:
        return Version(str(text)) if text else None
    except InvalidVersion:
        return None


def checker_fields(config: P2PConfig, server_version: str | None, action: str) -> tuple[dict[str, Any], list[str]]:
    """The optional weights_checker fields this server accepts for `action`, and notes on what was dropped."""
    version = parse_version(server_version)
    shown = f"{server_version} predates" if version else f"of unknown version ({server_version!r}) may predate"
    fields: dict[str, Any] = {}
    dropped: list[str] = []
    if action == "compare" and config.check_weight_update_allow_quant_error:
        if version is not None and version >= ALLOW_QUANT_ERROR_SINCE:
            fields["allow_quant_error"] = True
        else:
            dropped.append(f"allow_quant_error not sent: SGLang {shown} it (needs >= {ALLOW_QUANT_ERROR_SINCE})")
    if action in _SKIP_LIST_ACTIONS and config.check_weight_update_skip_list:
        if version is not None and version >= SKIP_TENSOR_LIST_SINCE:
            fields["skip_tensor_list"] = list(config.check_weight_update_skip_list)
        else:
            dropped.append(f"skip_tensor_list not sent: SGLang {shown} it (needs >= {SKIP_TENSOR_LIST_SINCE})")
    return fields, dropped


class WeightUpdateChecker:
    """Arms (snapshot + reset) once before the first sync; compares each armed replica after every sync until
    its compare passed."""

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
        self._armed: dict[int, Any] = {}  # engine -> adapter snapshotted and reset, its compare not passed yet
        self._noted: set[str] = set()

    @property
    def wants_arm(self) -> bool:
        return self.state == "pending"

    @property
    def wants_compare(self) -> bool:
        return self.state == "armed"

    async def arm(self, adapters: Sequence[Any]) -> None:
        """`snapshot` then `reset_tensors` on every replica (replicas in parallel)."""
        self.state = "failed"  # a partial arm leaves random weights: never snapshot those later
        await self._each(adapters, ("snapshot", "reset_tensors"), "before the first sync")
        self._armed = {a.engine: a for a in adapters}
        self.state = "armed"
        logger.info("check_weight_update_equal: snapshot + reset_tensors done on %d replica(s)", len(adapters))

    async def compare(self, adapters: Sequence[Any]) -> None:
        """`compare` on every armed replica among `adapters`; raises WeightCheckError naming each mismatch.
        Those that passed are done; the others (failed, or not among `adapters`) are compared next time."""
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
                if adapter.engine not in failed:
                    self._armed.pop(adapter.engine, None)
            if not self._armed:
                self.state = "done"
        logger.info("check_weight_update_equal: compare passed on %d replica(s)", len(targets))

    def forget(self, engine: int) -> None:
        """A replica replaced by a new server (never snapshotted): nothing to compare it with."""
        self._armed.pop(engine, None)
        if self.state == "armed" and not self._armed:
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
