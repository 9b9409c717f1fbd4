"""verl-p2p: checkpoint-engine backend `p2p` (Megatron trainer -> SGLang rollout over Mooncake writes).

Importing this package imports nothing heavy: it arranges for `p2p` to be registered in verl's
CheckpointEngineRegistry as soon as verl imports its registry (see plugin.py). It is loaded by verl's
`verl.plugins` entry point on every `import verl`, or by `checkpoint_engine.custom_backend_module=verl_p2p`.
"""

from verl_p2p.backend import plugin as _plugin

__version__ = "0.1.0"

_plugin.install()

_PUBLIC = {
    "P2PCheckpointEngine": "verl_p2p.backend.engine",
    "P2PCheckpointEngineManager": "verl_p2p.backend.manager",
    "P2PConfig": "verl_p2p.config",
    "P2PGuardCallback": "verl_p2p.backend.hydra_callback",
    "check_config": "verl_p2p.backend.guards",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'verl_p2p' has no attribute {name!r}")
