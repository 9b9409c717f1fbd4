"""P2PGuardCallback: a Hydra callback that stops a p2p run whose config cannot work, before verl starts anything.

conf/p2p/default.yaml installs it (`hydra.callbacks.verl_p2p_guard`); Hydra calls it in the driver at job start
with the composed config and the task function, which tells which verl trainer is about to run. Hydra turns an
exception raised by a callback into a warning and runs the job anyway, so the refusal is a SystemExit carrying
the guard's message (exit status 1).
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.experimental.callback import Callback

from verl_p2p.backend.guards import check_config, entry_of
from verl_p2p.errors import P2PConfigError

logger = logging.getLogger(__name__)


class P2PGuardCallback(Callback):
    def on_job_start(self, config: Any, *, task_function: Any = None, **kwargs: Any) -> None:
        try:
            check_config(config, entry_of(config, task_function), guard=True)
        except P2PConfigError as exc:
            logger.error("%s", exc)
            raise SystemExit(f"verl_p2p refused the run: {exc}") from exc
