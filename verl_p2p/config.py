"""P2PConfig: every `checkpoint_engine.engine_kwargs.verl_p2p.*` option, its default, and its validation.

verl rejects unknown keys directly under `checkpoint_engine`, so the backend's options live under
`engine_kwargs.<backend>` (verl passes the entry named like the backend: `verl_p2p`, or `p2p` with
`backend=p2p`). A wrong key or value raises one P2PConfigError that lists the valid keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_p2p.errors import P2PConfigError

_CHOICES = {
    "transport": ("mooncake", "nixl"),
    "protocol": ("rdma", "tcp"),
    "pause_mode": ("abort", "retract"),
    "export_mode": ("auto", "pp_local", "filter_full"),
    "executor": ("compiled", "sglang"),
    "staging": ("auto", "gpu", "pinned"),
}
OPTIONS = "checkpoint_engine.engine_kwargs.verl_p2p (engine_kwargs.p2p with backend=p2p)"
# options holding a list of tensor names (or fnmatch patterns); a comma-separated string is accepted too
_NAME_LISTS = ("check_weight_update_skip_list", "unused_hf_tensors_allowed", "unwritten_params_allowed")


@dataclass(frozen=True)
class P2PConfig:
    """Options of the p2p backend; the defaults are the production ones (Mooncake over RDMA)."""

    transport: str = "mooncake"
    protocol: str = "rdma"
    device_name: str = ""  # RDMA NIC(s): name, comma list, or JSON map GPU->NIC; "" lets Mooncake choose
    hostname: str | None = None  # address the rollout reaches this source at; None: the node IP
    p2p_transfer_num_workers: int = 8  # write threads per source (at most one per target engine is used)
    p2p_transfer_timeout: float = 60.0  # seconds one target's write may take before the push fails
    p2p_push_deadline_s: float = 600.0  # seconds a trainer rank's push (export + writes) may take; late: failed
    p2p_prepare_deadline_s: float = 1200.0  # seconds a trainer rank's prepare / plan round may take; late: failed
    p2p_push_retries: int = 1  # re-pushes of failed targets within one sync (rank info re-read first); 0: none
    p2p_max_consecutive_failures: int = 3  # the N-th failed sync in a row stops the run (1: the first one does)
    bucket_size_mb: int = 512  # one transfer-buffer slot; two slots per source
    pause_mode: str = "abort"
    http_timeout: float = 60.0  # seconds per control-plane call
    api_key: str | None = None  # bearer token of the rollout servers' admin endpoints
    check_weight_update_equal: bool = False
    check_weight_update_allow_quant_error: bool = False
    check_weight_update_skip_list: tuple[str, ...] = ()
    export_mode: str = "auto"
    release_buffers_on_save: bool = True
    executor: str = "compiled"  # HF -> rollout bytes: compiled copy programs, or SGLang's load_weights per param
    verify_first_push: bool = True  # check every compiled program of a plan generation against SGLang's loader at apply
    staging: str = "auto"  # transfer slots in GPU memory (gpu), pinned host memory (pinned), or choose (auto)
    plan_cache_dir: str | None = None  # captured write plans on disk; None: ~/.cache/verl_p2p/plans, "": no cache
    unused_hf_tensors_allowed: tuple[str, ...] = ()  # fnmatch patterns of streamed HF names no rollout param takes
    unwritten_params_allowed: tuple[str, ...] = ()  # fnmatch patterns of published rollout params no sync writes
    rollout_model_path: str | None = None  # the rollout's HF checkpoint when it is not the trainer's (FP8 rollouts)
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> P2PConfig:
        """Build from the backend's options (a dict or an OmegaConf node); raise on any unknown key or bad value."""
        options = plain(options)
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise P2PConfigError(f"{OPTIONS} must be a mapping of options, got {type(options).__name__} {options!r}")
        options = dict(options)
        unknown = sorted(set(options) - set(cls.valid_keys()))
        if unknown:
            raise P2PConfigError(f"unknown {OPTIONS} key(s) {unknown}; valid keys: {cls.valid_keys()}")
        for key in _NAME_LISTS:
            if key in options:
                names = options[key] or ()
                if isinstance(names, str):
                    names = [s for s in names.split(",") if s]
                options[key] = tuple(names) if isinstance(names, (list, tuple)) else names
        try:
            config = cls(**options)
        except TypeError as exc:  # pragma: no cover - guarded by the unknown-key check
            raise P2PConfigError(f"{exc}; valid keys: {cls.valid_keys()}") from exc
        config.validate()
        return config

    def validate(self) -> None:
        errors = []
        for key, choices in _CHOICES.items():
            if getattr(self, key) not in choices:
                errors.append(f"{key}={getattr(self, key)!r} (choose one of {list(choices)})")
        for key in ("p2p_transfer_num_workers", "bucket_size_mb"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                errors.append(f"{key}={value!r} (a positive integer)")
        retries = self.p2p_push_retries
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            errors.append(f"p2p_push_retries={retries!r} (a non-negative integer)")
        failures = self.p2p_max_consecutive_failures
        if not isinstance(failures, int) or isinstance(failures, bool) or failures < 1:
            errors.append(
                f"p2p_max_consecutive_failures={failures!r} (a positive integer: the number of failed syncs in a row "
                "that stops the run; 1 stops it at the first failed sync)"
            )
        for key in ("p2p_transfer_timeout", "http_timeout", "p2p_push_deadline_s", "p2p_prepare_deadline_s"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                errors.append(f"{key}={value!r} (a positive number of seconds)")
        for key in (
            "check_weight_update_equal",
            "check_weight_update_allow_quant_error",
            "release_buffers_on_save",
            "verify_first_push",
        ):
            if not isinstance(getattr(self, key), bool):
                errors.append(f"{key}={getattr(self, key)!r} (true or false)")
        deadline, transfer = self.p2p_push_deadline_s, self.p2p_transfer_timeout
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (deadline, transfer)) and (
            deadline <= transfer
        ):
            errors.append(
                f"p2p_push_deadline_s={deadline!r} is not above p2p_transfer_timeout={transfer!r} (a push waits for "
                "its writes up to the transfer timeout: the push deadline must leave room for it and the export)"
            )
        if self.staging == "gpu" and self.protocol == "tcp":
            errors.append(
                "staging='gpu' with protocol='tcp' (Mooncake's tcp path stages GPU memory through the host: GPU -> "
                "host-memory writes arrived corrupted on an H200; use staging=pinned or auto over tcp, or "
                "protocol=rdma)"
            )
        if self.rollout_model_path is not None and not (
            isinstance(self.rollout_model_path, str) and self.rollout_model_path
        ):
            errors.append(f"rollout_model_path={self.rollout_model_path!r} (an HF checkpoint directory, or null)")
        if self.plan_cache_dir is not None and not isinstance(self.plan_cache_dir, str):
            errors.append(f"plan_cache_dir={self.plan_cache_dir!r} (a directory path, or '' to disable the plan cache)")
        for key in _NAME_LISTS:
            value = getattr(self, key)
            if not isinstance(value, tuple) or not all(isinstance(s, str) and s for s in value):
                errors.append(f"{key}={value!r} (a list of tensor names or patterns)")
        if errors:
            raise P2PConfigError(
                f"invalid {OPTIONS} value(s): " + "; ".join(errors) + f"; valid keys: {self.valid_keys()}"
            )

    @property
    def bucket_size_bytes(self) -> int:
        return self.bucket_size_mb << 20


def config_field(node: Any, key: str) -> Any:
    """`node[key]` of a verl config node, whether a dict, an OmegaConf node or a dataclass; None when absent."""
    if node is None:
        return None
    if isinstance(node, Mapping):
        return node.get(key)
    return getattr(node, key, None)


def plain(options: Any) -> Any:
    """OmegaConf nodes to plain containers without importing omegaconf when it is not needed."""
    if options is None or isinstance(options, (dict, str, int, float, bool, list, tuple)):
        return options
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(options, DictConfig):
            return OmegaConf.to_container(options, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return dict(options)
