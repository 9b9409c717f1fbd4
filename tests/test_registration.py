"""`p2p` in verl 0.9.1's real CheckpointEngineRegistry: via the entry point, via custom_backend_module, and a
broken install that must fail loudly with the real cause (each in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def start_python(code: str, **env: str) -> subprocess.Popen:
    """Start `code` in a fresh interpreter (they run side by side: `import verl` takes seconds)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


def result_of(proc: subprocess.Popen) -> dict:
    """The JSON line the program printed last."""
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


DEFAULT = """
        import json, sys
        import verl
        lazy = {m: m in sys.modules for m in ("verl_p2p", "verl_p2p.backend.engine", "verl.checkpoint_engine")}
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl_p2p.backend.engine import P2PCheckpointEngine
        cls = CheckpointEngineRegistry.get("p2p")
        from verl.workers.rollout.replica import RolloutReplicaRegistry, _load_sglang
        loader = RolloutReplicaRegistry._registry["sglang"]
        print(json.dumps({
            "lazy": lazy,
            "is_p2p": cls is P2PCheckpointEngine,
            "others_kept": sorted(k for k in ("naive", "mooncake") if k in CheckpointEngineRegistry._registry),
            "replica_loader_wraps_verls": getattr(loader, "original", None) is _load_sglang,
        }))
"""

PLUGINS_OFF = """
    import json, sys
    import verl
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
    from verl.workers.config import CheckpointEngineConfig
    before = "p2p" in CheckpointEngineRegistry._registry
    config = CheckpointEngineConfig(backend="p2p", custom_backend_module="verl_p2p")
    manager = CheckpointEngineManager(config=config, actor_wg=None, replicas=[])  # verl's own manager
    print(json.dumps({
        "before": before,
        "backend_cls": f"{manager.backend_cls.__module__}.{manager.backend_cls.__name__}",
    }))
"""

ENGINE_FIRST = """
    import json
    from verl_p2p.backend.engine import P2PCheckpointEngine  # imports verl, whose registry import runs our hook
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl_p2p.backend import plugin
    print(json.dumps({"is_p2p": CheckpointEngineRegistry.get("p2p") is P2PCheckpointEngine,
                      "errors": [repr(e) for e in plugin.LOAD_ERRORS.values()]}))
"""

BROKEN = """
    import importlib.abc, json, sys

    class Broken(importlib.abc.MetaPathFinder):  # a dependency of the engine module that cannot load
        def find_spec(self, name, path, target=None):
            if name == "verl_p2p.backend.topology":
                raise ImportError("simulated: libp2pdep.so: cannot open shared object file")

    sys.meta_path.insert(0, Broken())
    import verl
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl_p2p.errors import P2PError

    def failure(call):
        try:
            call()
        except P2PError as exc:
            cause = exc.__cause__
            return {"message": str(exc), "cause": f"{type(cause).__name__}: {cause}"}
        return None

    out = {
        "registered": "p2p" in CheckpointEngineRegistry._registry,
        "construct": failure(lambda: CheckpointEngineRegistry.new("p2p", bucket_size=1 << 20, is_master=True)),
        "rollout": failure(lambda: CheckpointEngineRegistry.new("p2p", bucket_size=1 << 20)),
        "topology": failure(lambda: CheckpointEngineRegistry.get("p2p").build_topology(1, 1, [{}, {}])),
    }
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def programs() -> dict[str, dict]:
    started = {
        "default": start_python(DEFAULT),
        "plugins_off": start_python(PLUGINS_OFF, VERL_USE_EXTERNAL_PLUGINS="none"),
        "broken": start_python(BROKEN),
        "engine_first": start_python(ENGINE_FIRST),
    }
    return {name: result_of(proc) for name, proc in started.items()}


def test_import_verl_registers_p2p_lazily_and_resolves_it(programs):
    out = programs["default"]
    # the entry point ran inside `import verl` but registered nothing heavy before verl imported its registry
    assert out["lazy"] == {"verl_p2p": True, "verl_p2p.backend.engine": False, "verl.checkpoint_engine": False}
    assert out["is_p2p"]
    assert out["others_kept"] == ["mooncake", "naive"]
    assert out["replica_loader_wraps_verls"]


def test_custom_backend_module_registers_when_entry_points_are_off(programs):
    out = programs["plugins_off"]
    assert out["before"] is False  # entry points off: nothing registered p2p during `import verl`
    assert out["backend_cls"] == "verl_p2p.backend.engine.P2PCheckpointEngine"


def test_importing_the_engine_module_first_still_registers_it(programs):
    assert programs["engine_first"] == {"is_p2p": True, "errors": []}


def test_broken_dependency_raises_the_real_cause_where_p2p_is_used(programs):
    out = programs["broken"]
    assert out["registered"]  # a stand-in, so verl never says "not registered"
    for where in ("construct", "rollout", "topology"):
        failure = out[where]
        assert failure is not None, f"{where}: using backend=p2p did not raise"
        assert "simulated: libp2pdep.so" in failure["message"]
        assert failure["cause"] == "ImportError: simulated: libp2pdep.so: cannot open shared object file"
        assert "checkpoint_engine.backend='verl_p2p' (or 'p2p') is unavailable" in failure["message"]


def test_this_process_registered_the_real_engine():
    import verl  # noqa: F401
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from verl_p2p.backend import plugin
    from verl_p2p.backend.engine import P2PCheckpointEngine

    assert plugin.LOAD_ERRORS == {}
    plugin.raise_load_error("backend")  # nothing recorded: no exception
    assert CheckpointEngineRegistry.get("p2p") is P2PCheckpointEngine
