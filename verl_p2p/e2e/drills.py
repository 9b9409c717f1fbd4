"""The e2e harness's failure drills and what a failed sync must leave (a mixin of `run.Harness`).

`kill`: the trainer SIGKILLed half-way through its push's first batch, checked to have died mid-push; after any
failed sync the server must stay serviceable and not serve unknown weights; calls sent while paused must be
answered, and generations held while paused or stale must be served with the weights of the sync that resumes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from verl_p2p.e2e.checks import Check, killed_mid_push_check
from verl_p2p.e2e.records import SyncRecord


class Drills:
    """Drill steps of `Harness` (they use its rollout, client, trainer, expectations and `_generate`)."""

    async def _after_failure(self, record: SyncRecord) -> None:
        """What the failure left: the server must stay serviceable, and not serve unknown weights."""
        try:
            await self.client.server_info(timeout=10)
            serviceable = True
        except Exception as exc:  # noqa: BLE001 - recorded
            serviceable, record.notes["server_info_error"] = False, str(exc)
        record.checks.append(Check("server_serviceable_after_failure", serviceable and self.rollout.alive()))
        if not self.rollout.generates:
            paused = not self.rollout.serving()
            record.checks.append(Check("unknown_weights_not_served", paused, "paused" if paused else "resumed"))
        else:
            # SGLang holds a request that comes while paused and serves it on resume: it must not answer now, and
            # must answer with the weights of the sync that resumes it (checked there)
            task = asyncio.ensure_future(self._generate(self.rollout, self.client, timeout=600, side=True))
            await asyncio.wait({task}, timeout=getattr(self.args, "probe_timeout", 5))
            if task.done() and task.exception() is None:
                record.notes["served_after_failure"] = task.result()
                ok = False
            else:
                what = f"failed ({type(task.exception()).__name__})" if task.done() else "held"
                record.notes["generate_after_failure"] = f"not served ({what})"
                ok = True
                if not task.done():
                    self.held_generations.append((task, getattr(self.rollout, "starts", 0)))
            record.checks.append(Check("unknown_weights_not_served", ok, str(record.notes.get("served_after_failure"))))

    async def _killed_push(self, marker: Path, record: SyncRecord) -> dict:
        """Start a push that stalls half-way through its first batch of writes and SIGKILL the trainer there (the
        caller starts a new one)."""
        call = asyncio.ensure_future(
            asyncio.to_thread(self.trainer.call, "push", {"stall_after_batches": 1, "stall_marker": str(marker)})
        )
        t0 = time.perf_counter()
        while not marker.exists() and not call.done() and time.perf_counter() - t0 < 120:
            await asyncio.sleep(0.01)
        record.notes["killed_mid_push"] = marker.exists()
        record.notes["kill_after_s"] = round(time.perf_counter() - t0, 4)
        self.trainer.kill()
        await call  # raises TrainerDied
        raise AssertionError("unreachable: the killed trainer answered")

    async def _killed_mid_push(self, marker: Path, weights: int) -> Check:
        """The kill drill's own check: the trainer died mid-push (some, not all, new bytes in the rollout)."""
        try:
            held = await self.rollout.checksums(self.client)
        except Exception:  # noqa: BLE001 - the check says the checksums could not be read
            held = None
        old, new = self.expect[self.held].checksums, self.expect[weights].checksums
        return killed_mid_push_check(marker.exists(), old, new, held)

    async def _paused_calls(self, record: SyncRecord) -> dict[str, asyncio.Task]:
        """While paused for the sync: control calls must be answered; a generation must wait for the new weights."""
        answers = {}
        for name, call in (
            ("server_info", lambda: self.client.server_info(timeout=10)),
            ("flush_cache", lambda: self.client.flush_cache(timeout=10)),
            ("checksum", lambda: self.rollout.checksums(self.client)),
        ):
            try:
                await call()
                answers[name] = "answered"
            except Exception as exc:  # noqa: BLE001 - recorded and checked
                answers[name] = f"{type(exc).__name__}: {exc}"
        record.notes["control_calls_while_paused"] = answers
        record.checks.append(
            Check("control_calls_answered_while_paused", all(v == "answered" for v in answers.values()), str(answers))
        )
        if not self.rollout.generates:
            return {}
        sent = time.perf_counter()
        task = asyncio.ensure_future(self._generate(self.rollout, self.client, timeout=300, side=True))
        await asyncio.sleep(0.5)
        record.notes["generation_sent_while_paused_done_before_resume"] = task.done()
        record.notes["generation_sent_at"] = sent
        return {"generation_while_paused": task}

    async def _held_results(self, record: SyncRecord, weights: int) -> None:
        """The generations a stale rollout held: served now that a sync wrote it, with that sync's weights (one
        sent to a server process since restarted died with it, and is only noted)."""
        held, self.held_generations = self.held_generations, []
        for task, server_start in held:
            try:
                got = await asyncio.wait_for(task, timeout=120)
            except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - recorded and checked
                if server_start != getattr(self.rollout, "starts", 0):
                    record.notes.setdefault("held_generations_lost_in_restart", []).append(type(exc).__name__)
                    continue
                got = f"{type(exc).__name__}: {exc}"
            expected = self.expect[weights].side_generation
            record.checks.append(
                Check("generation_held_while_stale_served_with_new_weights", got == expected, f"got {got}")
            )

    async def _side_result(self, record: SyncRecord, name: str, task: asyncio.Task, weights: int) -> None:
        try:
            got = await task
        except Exception as exc:  # noqa: BLE001 - recorded and checked
            record.checks.append(Check(name, False, f"{type(exc).__name__}: {exc}"))
            return
        expected = self.expect[weights].side_generation
        waited = not record.notes.get("generation_sent_while_paused_done_before_resume", True)
        record.checks.append(
            Check(f"{name}_served_after_sync_with_new_weights", got == expected and waited, f"got {got}")
        )
