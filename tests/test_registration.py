"""`verl_p2p` (and `p2p`) in verl 0.9.1's real CheckpointEngineRegistry: via the entry point, via
custom_backend_module, a broken install that must fail loudly with the real cause, and a foreign class holding
`p2p` (verl's own p2p backend, proposed upstream; here a class of the test program registered in verl's real
registry before and after ours): never overwritten, logged, and refused by name wherever verl_p2p's
configuration is in use with `backend=p2p` (each in a fresh interpreter)."""

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


LOGS = """
    import json, logging
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("verl_p2p").addHandler(Keep())
    logging.getLogger("verl_p2p").setLevel(logging.INFO)
"""

# what verl_p2p's configuration looks like with `backend=p2p` (a trainer config, as the Hydra guard sees it)
USES = """
    def trainer_config(backend, **checkpoint_engine):
        return {
            "trainer": {"use_v1": True, "v1": {"trainer_mode": "separate_async"}},
            "actor_rollout_ref": {"rollout": {
                "name": "sglang",
                "checkpoint_engine": {"backend": backend, **checkpoint_engine},
                "engine_kwargs": {"sglang": {
                    "remote_instance_weight_loader_start_seed_via_transfer_engine": True,
                    "enable_memory_saver": False,
                    "engine_info_bootstrap_port": 6789,
                }},
            }},
        }

    def refusal(call):
        from verl_p2p.errors import P2PConfigError
        try:
            call()
        except P2PConfigError as exc:
            return str(exc)
        return None

    def manager(backend, options):
        from verl.workers.config import CheckpointEngineConfig
        from verl_p2p.backend.manager import P2PCheckpointEngineManager
        config = CheckpointEngineConfig(backend=backend, engine_kwargs={backend: options})
        return P2PCheckpointEngineManager(config=config, actor_wg=None, replicas=[])

    def uses(backend, **checkpoint_engine):
        from verl.workers.config import CheckpointEngineConfig, RolloutConfig
        from verl_p2p.rollout.launch import uses_p2p
        checkpoint = CheckpointEngineConfig(backend=backend, **checkpoint_engine)
        return uses_p2p(RolloutConfig(name="sglang", checkpoint_engine=checkpoint))

    def checks():
        from verl_p2p.backend.guards import config_problems
        return {
            "guard_p2p": config_problems(trainer_config("p2p", engine_kwargs={"p2p": {"protocol": "tcp"}})),
            "guard_p2p_hydra": config_problems(trainer_config("p2p"), guard=True),
            "guard_p2p_not_ours": config_problems(trainer_config("p2p")),
            "guard_alias": config_problems(trainer_config("verl_p2p", engine_kwargs={"verl_p2p": {"protocol": "tcp"}})),
            "manager_p2p": refusal(lambda: manager("p2p", {})),
            "manager_alias": manager("verl_p2p", {"protocol": "tcp"}).p2p_config.protocol,
            "launch_p2p": refusal(lambda: uses("p2p", custom_backend_module="verl_p2p")),
            "launch_p2p_not_ours": uses("p2p"),
            "launch_alias": uses("verl_p2p"),
        }
"""

FOREIGN_FIRST = (
    LOGS
    + USES
    + """
    from verl_p2p.backend import plugin

    def register_foreign(base):  # inside verl's package import, before verl_p2p's hook: as verl's own p2p would
        class ForeignP2PCheckpointEngine(base.CheckpointEngine):
            pass

        base.CheckpointEngineRegistry.register("p2p")(ForeignP2PCheckpointEngine)

    plugin.when_imported("verl.checkpoint_engine.base", register_foreign)
    import verl
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl_p2p.backend.engine import P2PCheckpointEngine
    p2p = CheckpointEngineRegistry.get("p2p")
    out = {
        "p2p": f"{p2p.__module__}.{p2p.__qualname__}",
        "alias_is_ours": CheckpointEngineRegistry.get("verl_p2p") is P2PCheckpointEngine,
        "logs": records,
        **checks(),
    }
    print(json.dumps(out))
"""
)

FOREIGN_AFTER = (
    LOGS
    + USES
    + """
    import verl
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    from verl_p2p.backend.engine import P2PCheckpointEngine
    before = CheckpointEngineRegistry.get("p2p") is P2PCheckpointEngine

    class LaterP2PCheckpointEngine(CheckpointEngine):  # registered after verl_p2p: overwrites `p2p`
        pass

    CheckpointEngineRegistry.register("p2p")(LaterP2PCheckpointEngine)
    print(json.dumps({"before": before, "logs": records, **checks()}))
"""
)

NAMES = (
    LOGS
    + USES
    + """
    import verl
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl_p2p.backend.engine import P2PCheckpointEngine
    out = {
        "p2p_is_ours": CheckpointEngineRegistry.get("p2p") is P2PCheckpointEngine,
        "alias_is_ours": CheckpointEngineRegistry.get("verl_p2p") is P2PCheckpointEngine,
        "logs": records,
        "manager_p2p_options": manager("p2p", {"protocol": "tcp"}).p2p_config.protocol,
        **checks(),
    }
    print(json.dumps(out))
"""
)


@pytest.fixture(scope="module")
def programs() -> dict[str, dict]:
    started = {
        "default": start_python(DEFAULT),
        "plugins_off": start_python(PLUGINS_OFF, VERL_USE_EXTERNAL_PLUGINS="none"),
        "broken": start_python(BROKEN),
        "engine_first": start_python(ENGINE_FIRST),
        "foreign_first": start_python(FOREIGN_FIRST),
        "foreign_after": start_python(FOREIGN_AFTER),
        "names": start_python(NAMES),
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
    assert CheckpointEngineRegistry.get("verl_p2p") is P2PCheckpointEngine


OURS = "verl_p2p.backend.engine.P2PCheckpointEngine"


def assert_names_both(text: str | None, foreign: str) -> None:
    assert text is not None, "not refused"
    assert f"checkpoint_engine.backend=p2p resolves to {foreign}, not verl_p2p's {OURS}" in text
    assert "Fix: checkpoint_engine.backend=verl_p2p" in text


def test_both_names_resolve_to_ours_when_nobody_else_holds_p2p(programs):
    out = programs["names"]
    assert out["p2p_is_ours"] and out["alias_is_ours"]
    assert f"verl_p2p: checkpoint_engine backends 'verl_p2p' and 'p2p' resolve to {OURS}" in out["logs"]
    assert out["manager_p2p"] is None  # not refused
    assert out["manager_p2p_options"] == "tcp" and out["manager_alias"] == "tcp"  # options: engine_kwargs.<backend>
    assert out["guard_p2p"] == [] and out["guard_p2p_hydra"] == [] and out["guard_alias"] == []
    assert out["launch_p2p"] is None and out["launch_alias"] is True and out["launch_p2p_not_ours"] is True


def test_a_foreign_p2p_registered_first_is_kept_logged_and_refused_with_our_config(programs):
    out = programs["foreign_first"]
    foreign = "__main__.register_foreign.<locals>.ForeignP2PCheckpointEngine"
    assert out["p2p"] == foreign and out["alias_is_ours"]  # never overwritten; ours stays reachable
    assert any(f"'p2p' is already {foreign} (not overwritten): it is NOT verl_p2p" in line for line in out["logs"])
    (problem,) = out["guard_p2p"]  # engine_kwargs.p2p holds verl_p2p's options
    assert_names_both(problem, foreign)
    assert "engine_kwargs.p2p holds verl_p2p's options (protocol)" in problem
    (problem,) = out["guard_p2p_hydra"]  # verl_p2p's Hydra guard is installed
    assert_names_both(problem, foreign)
    assert out["guard_p2p_not_ours"] == []  # nothing of verl_p2p's in use: the other backend runs undisturbed
    assert_names_both(out["manager_p2p"], foreign)
    assert_names_both(out["launch_p2p"], foreign)  # custom_backend_module=verl_p2p
    assert out["launch_p2p_not_ours"] is False  # verl's replica behaviour for the other backend
    assert out["guard_alias"] == [] and out["manager_alias"] == "tcp" and out["launch_alias"] is True


def test_a_foreign_p2p_registered_after_ours_is_refused_with_our_config(programs):
    out = programs["foreign_after"]
    foreign = "__main__.LaterP2PCheckpointEngine"
    assert out["before"]
    assert f"verl_p2p: checkpoint_engine.backend=p2p resolves to {foreign}" in out["logs"]  # logged where checked
    assert_names_both(out["manager_p2p"], foreign)
    assert_names_both(out["guard_p2p"][0], foreign)
    assert_names_both(out["launch_p2p"], foreign)
    assert out["guard_alias"] == [] and out["manager_alias"] == "tcp" and out["launch_alias"] is True
