"""Which checkpoint-engine class is verl_p2p's, and whether a config means it (no heavy imports).

The engine is registered as `verl_p2p` and, unless another class already holds it, as `p2p` (`register_engine`,
called by `engine.py` and by `plugin.py`'s stand-in). These
checks tell, wherever a config is read (the Hydra guard, the manager, replica launch), whether `backend` runs this
package's engine, and refuse a config set up for verl_p2p while `backend=p2p` resolves to another package's class.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

BACKEND = "p2p"  # the short name: ours unless another class holds it
ALIAS = "verl_p2p"  # always ours; conf/ uses it
BACKEND_NAMES = (ALIAS, BACKEND)
ENGINE_CLASS = "verl_p2p.backend.engine.P2PCheckpointEngine"
MANAGER_CLASS = "verl_p2p.backend.manager.P2PCheckpointEngineManager"


def is_ours(cls: Any) -> bool:
    return str(getattr(cls, "__module__", "")).split(".")[0] == "verl_p2p"


def class_name(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"


def resolved_class(backend: str) -> type | None:
    """The class verl's registry holds under `backend` now (None when unregistered)."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    return CheckpointEngineRegistry._registry.get(backend)


def our_config_signs(rollout: Any) -> list[str]:
    """What in a rollout config (`actor_rollout_ref.rollout`, or its checkpoint_engine section) says this
    package's backend is meant: its custom_backend_module, its manager, options under `verl_p2p`, or options
    under `p2p` that are all this package's keys."""
    from verl_p2p.config import P2PConfig, config_field

    checkpoint_engine = config_field(rollout, "checkpoint_engine")
    if checkpoint_engine is None:
        checkpoint_engine, rollout = rollout, None
    signs = []
    if config_field(checkpoint_engine, "custom_backend_module") == "verl_p2p":
        signs.append("checkpoint_engine.custom_backend_module=verl_p2p")
    if config_field(rollout, "checkpoint_manager_class") == MANAGER_CLASS:
        signs.append(f"checkpoint_manager_class={MANAGER_CLASS}")
    engine_kwargs = config_field(checkpoint_engine, "engine_kwargs") or {}
    if config_field(engine_kwargs, ALIAS) is not None:
        signs.append(f"engine_kwargs.{ALIAS} is set")
    short = config_field(engine_kwargs, BACKEND)
    if short and set(short) <= set(P2PConfig.valid_keys()):
        signs.append(f"engine_kwargs.{BACKEND} holds verl_p2p's options ({', '.join(sorted(map(str, short))[:4])})")
    return signs


def backend_problem(backend: Any, signs: list[str]) -> str | None:
    """Why `backend` must not run with this package's configuration: `p2p` resolves to another package's class
    while `signs` say verl_p2p is meant. None when the backend is ours (or our config is not in use)."""
    if backend != BACKEND or not signs:
        return None
    held = resolved_class(BACKEND)
    if held is None or is_ours(held):
        return None
    return (
        f"checkpoint_engine.backend={BACKEND} resolves to {class_name(held)}, not verl_p2p's {ENGINE_CLASS}, while "
        f"this config is set up for verl_p2p ({'; '.join(signs)}): verl would run the other backend. Fix: "
        f"checkpoint_engine.backend={ALIAS} with the options under checkpoint_engine.engine_kwargs.{ALIAS} (or drop "
        "verl_p2p's settings to use the other backend)"
    )


_logged: set[tuple[str, str]] = set()


def check_backend(backend: Any, signs: list[str]) -> None:
    """Raise P2PConfigError with `backend_problem`, if there is one; log (once) which class `backend` runs."""
    if backend in BACKEND_NAMES:
        held = class_name(resolved_class(backend)) if resolved_class(backend) is not None else "nothing"
        if (backend, held) not in _logged:
            _logged.add((backend, held))
            logger.info("verl_p2p: checkpoint_engine.backend=%s resolves to %s", backend, held)
    problem = backend_problem(backend, signs)
    if problem is not None:
        from verl_p2p.errors import P2PConfigError

        raise P2PConfigError(problem)


def uses_verl_p2p(backend: Any) -> bool:
    """`backend` runs this package's engine: `verl_p2p`, or `p2p` while it resolves to ours."""
    if backend == ALIAS:
        return True
    if backend != BACKEND:
        return False
    held = resolved_class(BACKEND)
    return held is None or is_ours(held)


def register_engine(cls: type) -> None:
    """Register `cls` as `verl_p2p`, and as `p2p` unless a class of another package holds that name already."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    CheckpointEngineRegistry.register(ALIAS)(cls)
    held = CheckpointEngineRegistry._registry.get(BACKEND)
    if held is None or is_ours(held):
        CheckpointEngineRegistry.register(BACKEND)(cls)
        logger.info("verl_p2p: checkpoint_engine backends %r and %r resolve to %s", ALIAS, BACKEND, class_name(cls))
    else:
        logger.warning(
            "verl_p2p: checkpoint_engine backend %r is already %s (not overwritten): it is NOT verl_p2p; "
            "use checkpoint_engine.backend=%s for verl_p2p (registered as %s)",
            BACKEND,
            class_name(held),
            ALIAS,
            class_name(cls),
        )
