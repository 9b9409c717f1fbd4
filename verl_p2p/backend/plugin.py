"""How `p2p` gets into verl, and how a broken install is reported instead of swallowed.

verl 0.9.1 imports every `verl.plugins` entry point inside `import verl` and logs a failing one at DEBUG only;
`checkpoint_engine.custom_backend_module=verl_p2p` imports this package again right before the backend is built.
Neither import should cost anything, so registration waits until verl itself imports the module that holds
the registry: a post-import hook runs `register_backend()` right after `verl.checkpoint_engine` executes (at
once when it is already imported), and `register_replica()` after `verl.workers.rollout.replica`.

If the backend's own modules cannot be imported, a stand-in is registered under our names that raises the
real cause (chained) when verl builds the engine or the driver builds the topology, so `backend=p2p` never
fails with "not registered" or, worse, silently.

Names: the engine is registered as `verl_p2p` (unambiguous, what conf/ uses) and as `p2p` unless another
class already holds `p2p` (verl's own p2p backend, proposed upstream, or another plugin): that one is never
overwritten. Which class `p2p` resolves to is logged, and wherever this package's configuration is in use
(its options, manager, Hydra guard or custom_backend_module) while `backend=p2p` resolves to another class,
`check_backend` refuses the run naming both classes (`backend=verl_p2p` is the fix).
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from verl_p2p.backend.identity import (  # noqa: F401 - re-exported: callers know these as plugin.*
    ALIAS,
    BACKEND,
    BACKEND_NAMES,
    ENGINE_CLASS,
    MANAGER_CLASS,
    backend_problem,
    check_backend,
    class_name,
    is_ours,
    our_config_signs,
    register_engine,
    resolved_class,
    uses_verl_p2p,
)

logger = logging.getLogger(__name__)

REGISTRY_MODULE = "verl.checkpoint_engine"
REPLICA_MODULE = "verl.workers.rollout.replica"

# What failed while registering, by part ("backend", "replica"); the stand-in raises these.
LOAD_ERRORS: dict[str, BaseException] = {}

_lock = threading.RLock()
_done: set[str] = set()


# ---- post-import hooks ------------------------------------------------------------------------------------


class _CallbackLoader(importlib.abc.Loader):
    """Runs the real loader, then `callback(module)`."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of one module name so a callback runs once that module has executed."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _PostImportFinder):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(spec.loader, self._fire)
        return spec

    def _fire(self, module: ModuleType) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        self.callback(module)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once `name` is imported: now if it already is, else right after it executes."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            if not any(isinstance(f, _PostImportFinder) and f.name == name for f in sys.meta_path):
                sys.meta_path.insert(0, _PostImportFinder(name, callback))
            return
    callback(module)


def install() -> None:
    """Arrange registration of the backend and of the replica launch hook (idempotent, imports nothing)."""
    when_imported(REGISTRY_MODULE, lambda _: register_backend())
    when_imported(REPLICA_MODULE, lambda _: register_replica())


# ---- registration ------------------------------------------------------------------------------------------


def register_backend() -> None:
    """Import verl_p2p.backend.engine, which registers `P2PCheckpointEngine` (`register_engine`); register the
    stand-in instead if that import fails."""
    with _lock:
        if "backend" in _done:
            return
        _done.add("backend")
    try:
        # When verl_p2p.backend.engine itself is being imported (it imports verl's registry), this returns the module
        # being initialised; it registers the class once it is defined.
        importlib.import_module("verl_p2p.backend.engine")
    except Exception as exc:  # noqa: BLE001 - any failure must surface when p2p is used, not here
        LOAD_ERRORS["backend"] = exc
        logger.warning("verl_p2p: backend %r is unavailable: %s: %s", ALIAS, type(exc).__name__, exc)
        register_engine(unavailable_engine_class(exc))


def register_replica() -> None:
    """Wrap verl's `sglang` rollout-replica loader so p2p replicas launch with per-replica server args."""
    with _lock:
        if "replica" in _done:
            return
        _done.add("replica")
    try:
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        original = RolloutReplicaRegistry._registry.get("sglang")
        if original is not None:
            RolloutReplicaRegistry.register("sglang", wrap_replica_loader(original))
    except Exception as exc:  # noqa: BLE001 - reported when a p2p rollout launches (see rollout/launch.py)
        LOAD_ERRORS["replica"] = exc
        logger.warning("verl_p2p: could not hook SGLang replica launch: %s: %s", type(exc).__name__, exc)


def load_error_message(part: str = "backend") -> str:
    exc = LOAD_ERRORS[part]
    return (
        f"checkpoint_engine.backend={ALIAS!r} (or {BACKEND!r}) is unavailable: verl_p2p failed to load "
        f"({type(exc).__name__}: {exc}). Fix the cause above (a missing or broken dependency of verl_p2p, "
        "or a verl version other than 0.9.1), then check with `python -c 'import verl_p2p.backend.engine'`."
    )


def raise_load_error(part: str = "backend") -> None:
    """Raise the recorded failure of `part`, chained, if there is one."""
    if part in LOAD_ERRORS:
        from verl_p2p.errors import P2PError

        raise P2PError(load_error_message(part)) from LOAD_ERRORS[part]


def unavailable_engine_class(exc: BaseException) -> type:
    """A CheckpointEngine stand-in that raises `exc` (chained) wherever verl would use the backend."""
    from verl.checkpoint_engine.base import CheckpointEngine

    def _raise(*args, **kwargs):
        raise_load_error("backend")

    class UnavailableP2PCheckpointEngine(CheckpointEngine):
        """Registered as `verl_p2p` (and `p2p`) when verl_p2p could not load; every use raises the real cause."""

        load_error = exc

        def __init__(self, *args, **kwargs):
            _raise()

        build_topology = classmethod(_raise)
        prepare = init_process_group = finalize = send_weights = receive_weights = _raise

    return UnavailableP2PCheckpointEngine


def wrap_replica_loader(original: Callable[[], type]) -> Callable[[], type]:
    """verl's `sglang` replica loader, returning P2PSGLangReplica (which behaves as verl's unless backend=p2p)."""

    def load() -> type:
        from verl_p2p.rollout.sglang_replica import P2PSGLangReplica

        return P2PSGLangReplica

    load.original = original
    return load
