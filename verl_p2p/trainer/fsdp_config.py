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
    """Every reason an FSDP actor in `config` cannot be a p2p source; [] for a Megatron actor or a servable one."""
    actor_rollout_ref = config_field(config, "actor_rollout_ref")
    strategy = config_field(config_field(actor_rollout_ref, "actor"), "strategy")
    if strategy not in FSDP_STRATEGIES:
        return []
    problems = []
    model = config_field(actor_rollout_ref, "model")
    lora_rank = config_field(model, "lora_rank") or 0
    merge = config_field(config_field(model, "lora") or {}, "merge")
    if int(lora_rank) > 0 and not merge:
        problems.append(
            f"actor.strategy={strategy} with model.lora_rank={lora_rank} and an unmerged adapter: verl's stream then "
            "yields adapter tensors, while p2p writes full weights. Fix: actor_rollout_ref.model.lora.merge=True"
        )
    options = config_field(config_field(config_field(config_field(actor_rollout_ref, "rollout"), "checkpoint_engine"),
                                        "engine_kwargs"), backend)  # fmt: skip
    mode = config_field(options, "export_mode") or "auto"
    if mode != "auto":
        problems.append(
            f"actor.strategy={strategy} with engine_kwargs.{backend}.export_mode={mode!r}: that is a Megatron export; "
            "the FSDP actor's only export is verl's full-tensor stream. Fix: export_mode=auto (or +p2p=fsdp)"
        )
    return problems
