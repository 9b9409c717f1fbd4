"""What the FSDP source cannot serve, read from the trainer config on the driver, before anything launches.

The same refusals run again where the source is built (`fsdp_export.refuse_unservable`, `refuse_export_mode`);
here they stop the run before Ray starts a worker. Pure config reads (no torch), for `backend.guards`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_p2p.config import config_field

FSDP_STRATEGIES = ("fsdp", "fsdp2")


def fsdp_actor_problems(config: Mapping[str, Any], backend: str = "verl_p2p") -> list[str]:
    """Every reason an FSDP actor in `config` cannot be a p2p source; [] for a Megatron actor or a servable one.
    LoRA is refused for every trainer by `backend.guards.lora_problem` (merged weights have no witness test yet)."""
    actor_rollout_ref = config_field(config, "actor_rollout_ref")
    strategy = config_field(config_field(actor_rollout_ref, "actor"), "strategy")
    if strategy not in FSDP_STRATEGIES:
        return []
    problems = []
    options = config_field(config_field(config_field(config_field(actor_rollout_ref, "rollout"), "checkpoint_engine"),
                                        "engine_kwargs"), backend)  # fmt: skip
    mode = config_field(options, "export_mode") or "auto"
    if mode != "auto":
        problems.append(
            f"actor.strategy={strategy} with engine_kwargs.{backend}.export_mode={mode!r}: that is a Megatron export; "
            "the FSDP actor's only export is verl's full-tensor stream. Fix: export_mode=auto (or +p2p=fsdp)"
        )
    return problems
