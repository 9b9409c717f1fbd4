"""Be "TP rank r of this rollout layout" inside one process, without a distributed world.

SGLang's model classes and weight loaders ask the parallel state who they are (tp rank, attention-TP rank,
expert-parallel rank, ...), read the global server args, the MoE backend config, the DP-attention flags
and the expert-location map. A `RankContext` prepares all of that for one rank of one layout and installs
it while entered, so SGLang builds and loads exactly the shard that rank holds. The group objects are
stand-ins (`StandInGroup`, rank_groups.py): they answer every question about membership and refuse communication.

Where that state lives depends on the release, and the adapter is chosen by what the installed SGLang offers
(`RankStateFeatures`), not by its version string; the adapters live in rank_adapters.py. Where the parallel groups
are module globals (0.5.12 .. 0.5.20), `_GlobalsAdapter` runs SGLang's own initializers once per rank and swaps the
globals they set in and out; from 0.5.14 part of that state (flags, resources, published config) lives in the
process-wide `runtime_context`, which then gets a fresh context per rank, swapped in with the globals. Where the
runtime context places ranks itself (`publish(..., ranks=SpawnRanks)`, 0.5.21 on), `_RuntimeContextAdapter` keeps
one context per rank (`create_context`/`use_context` where they exist, else a fresh context swapped in around
`publish`). Initializers are called with the arguments their signature in the installed release takes. Releases
outside `TESTED_SGLANG_RANGE` are refused with the range. Neither adapter is thread-safe, so every entry takes one
module lock (re-entrant)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from typing import Any

from verl_p2p.environment import environment_set  # noqa: F401 - also imported from here (tests/support)
from verl_p2p.errors import UnsupportedLayoutError
from verl_p2p.planning.layout import RankLayout, check_reproducible, layout_from_server_args
from verl_p2p.replica.rank_adapters import (  # noqa: F401 - HYBRID_CPU_SETTINGS, hybrid_linear_attention re-exported
    HYBRID_CPU_SETTINGS,
    INSTANCE_FIELDS,
    RANK_STATE_LOCK,
    _GlobalsAdapter,
    _RuntimeContextAdapter,
    _sglang_field_values,
    hybrid_linear_attention,
)
from verl_p2p.replica.rank_groups import StandInGroup, group_ranks, stand_in_groups  # noqa: F401 - re-exported

_LOCK = RANK_STATE_LOCK
logger = logging.getLogger(__name__)

# The SGLang releases the replica supports, both ends included (the `sglang` extra of pyproject.toml says the
# same). CI runs the replica-exact matrix on 0.5.12, 0.5.21 and 0.5.23 (tests/test_replica_exact.py).
TESTED_SGLANG_RANGE = ("0.5.12", "0.5.23")


class UnsupportedSGLangVersionError(UnsupportedLayoutError):
    """The installed SGLang release has no rank-context adapter here."""


def sglang_version() -> str:
    import sglang

    return str(sglang.__version__)


def base_version(version: str) -> str:
    """'0.5.12' from '0.5.12', '0.5.12.post1' or '0.5.12+local'."""
    return ".".join(re.split(r"[+]", str(version))[0].split(".")[:3])


def release_id(version: str) -> str:
    """The full release, normalized ('0.5.12.post1', '0.5.12+cu128' stay apart from '0.5.12'): post releases and
    local builds may load weights differently, so only equal release ids share plans and replicas."""
    text = str(version).strip()
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging comes with torch and transformers
        return text
    try:
        return str(Version(text))
    except InvalidVersion:
        return text


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"^\s*(\d+)\.(\d+)\.(\d+)", str(version))
    return tuple(int(x) for x in match.groups()) if match else None


def check_tested_range(version: str) -> None:
    """Refuse an SGLang release outside TESTED_SGLANG_RANGE, naming the range and the fix."""
    low, high = TESTED_SGLANG_RANGE
    release = _release(version)
    if release is None or not _release(low) <= release <= _release(high):
        raise UnsupportedSGLangVersionError(
            f"SGLang {version} is outside the range the p2p replica supports and is tested on ({low} .. {high}); "
            f"install a release in that range on the trainer (pip install 'sglang>={low},<={high}'), the same "
            "release the rollout servers run"
        )


@dataclasses.dataclass(frozen=True)
class RankStateFeatures:
    """Where the installed SGLang keeps the state that makes a process "rank r" (found by inspection)."""

    runtime_context: bool  # sglang.srt.runtime_context exists (else: module globals only)
    context_placement: bool  # publish(..., ranks=SpawnRanks) places the ranks, override_permanently stamps groups
    model_contexts: bool  # create_context + use_context (else: publish into a fresh context swapped in)
    record_fields: bool  # ServerArgs fields via arg_groups.arg_utils.record_fields (else dataclasses.fields)

    @classmethod
    def detect(cls) -> RankStateFeatures:
        if importlib.util.find_spec("sglang.srt.runtime_context") is None:
            return cls(False, False, False, False)
        import sglang.srt.runtime_context as rc

        publish = getattr(rc, "publish", None)
        placement = (
            hasattr(rc, "SpawnRanks")
            and hasattr(getattr(rc, "ParallelContext", None), "override_permanently")
            and publish is not None
            and "ranks" in inspect.signature(publish).parameters
        )
        return cls(
            runtime_context=True,
            context_placement=placement,
            model_contexts=hasattr(rc, "create_context") and hasattr(rc, "use_context"),
            record_fields=importlib.util.find_spec("sglang.srt.arg_groups.arg_utils") is not None,
        )

    def adapter_kind(self, version: str) -> str:
        """`runtime_context` where the context places ranks itself (0.5.21 on), else `module_globals`."""
        if self.runtime_context and self.context_placement:
            if not self.record_fields:
                raise UnsupportedSGLangVersionError(
                    f"SGLang {version} places ranks in its runtime context but has no "
                    "sglang.srt.arg_groups.arg_utils.record_fields to read its ServerArgs fields; the p2p replica "
                    f"supports {' .. '.join(TESTED_SGLANG_RANGE)}"
                )
            return "runtime_context"
        return "module_globals"


def _adapter_kind(version: str) -> str:
    check_tested_range(version)
    return RankStateFeatures.detect().adapter_kind(version)


def hf_config_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"hf_config must be a dict or a transformers PretrainedConfig, got {type(hf_config)}")
    return to_dict()


@functools.cache
def _private_config_base() -> str:
    """This user's own directory for config copies: `<tmp>/verl_p2p_cfg-<uid>`, mode 0700, owned by this user.

    A shared temporary directory lets anyone create that name first (or a symlink of it); such a directory
    (not ours, not private, not a directory) is never used: a fresh `mkdtemp` directory serves this process.
    Chosen once per process (`functools.cache`): every config copy of a process goes to one directory, and a
    fallback `mkdtemp` directory is made at most once.
    """
    uid = os.getuid()
    base = os.path.join(tempfile.gettempdir(), f"verl_p2p_cfg-{uid}")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        fresh = tempfile.mkdtemp(prefix="verl_p2p_cfg-")
        logger.warning(
            "p2p replica: %s is not a private directory of this user (owner uid %d, mode %o); writing rollout "
            "configs to %s instead. Remove %s if nobody else should own it",
            base,
            st.st_uid,
            stat.S_IMODE(st.st_mode),
            fresh,
            base,
        )
        base = fresh
    return base


def checkpoint_config_dir(hf_config: Any) -> str:
    """A directory holding only `config.json` of `hf_config` (SGLang's ModelConfig reads configs from a path).

    One directory per config digest inside this user's private directory (`_private_config_base`), so a killed
    process (Ray actors are) leaks nothing and no other user can plant a config (or code, with
    `trust_remote_code`) there. The file is checked against the config on every use and rewritten atomically
    when it differs, so concurrent writers never expose a half-written config.
    """
    text = json.dumps(hf_config_dict(hf_config), sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    with _LOCK:
        path = os.path.join(_private_config_base(), digest)
        target = os.path.join(path, "config.json")
        os.makedirs(path, mode=0o700, exist_ok=True)
        try:
            with open(target) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            fd, partial = tempfile.mkstemp(dir=path, prefix=".config.", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(partial, target)
    return path


def rollout_environment(server_args: Mapping[str, Any]) -> dict[str, bool]:
    """The rollout's environment settings that decide its bytes, as p2p carries them in server args (read from
    published sizes, `planning.shared_experts`): {} when none is set, so other plans keep their digests."""
    from verl_p2p.planning.shared_experts import SHARED_TP1

    return {SHARED_TP1: True} if server_args.get(SHARED_TP1) is True else {}


def _rollout_environment_set(settings: Mapping[str, bool]):
    """SGLang reads these from the process environment when it builds a model: each set to the rollout's value
    (never the trainer's own environment) while inside."""
    from verl_p2p.planning.shared_experts import SHARED_TP1

    return environment_set({SHARED_TP1: "1" if settings.get(SHARED_TP1) else "0"})


def server_args_fingerprint(server_args: Mapping[str, Any]) -> str:
    """Digest of the server args that decide a rank's bytes (instance fields such as ports left out)."""
    relevant = {k: v for k, v in server_args.items() if k not in INSTANCE_FIELDS}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()


def _check_model_level(server_args: Mapping[str, Any], hf: dict) -> None:
    from verl_p2p.replica.fp8 import quantization_problems

    problems = quantization_problems(server_args, hf)
    backend = str(server_args.get("moe_runner_backend") or "auto")
    if backend.startswith("flashinfer_trtllm") or backend == "flashinfer_mxfp4":
        problems.append(
            f"moe_runner_backend={backend!r} reorders expert weights after loading on the GPU; use 'auto' or 'triton'"
        )
    a2a = str(server_args.get("moe_a2a_backend") or "none")
    if a2a not in ("none", "None"):
        problems.append(f"moe_a2a_backend={a2a!r} is not supported by the replica; use 'none'")
    if server_args.get("enable_lora"):
        problems.append("LoRA adapters are not supported; turn enable_lora off")
    if problems:
        raise UnsupportedLayoutError("p2p replica cannot reproduce this rollout: " + "; ".join(problems))


def installed_sglang_version() -> str:
    """The SGLang release this process would import, without importing it when it is not loaded yet."""
    import sys

    module = sys.modules.get("sglang")
    if module is not None:
        return str(module.__version__)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return sglang_version()


def preflight(server_args: Mapping[str, Any], layout: RankLayout, hf_config: Any, version: str) -> None:
    """The checks a rank context makes before touching SGLang: layout, release and model-level settings."""
    check_reproducible(server_args)
    derived = layout_from_server_args(server_args, layout.tp_rank)
    if derived != layout:
        raise UnsupportedLayoutError(
            f"rank layout {layout} disagrees with the one its server args give ({derived}); "
            "pass the layout derived from the same /server_info"
        )
    check_tested_range(version)  # which adapter fits is decided when SGLang is first needed (RankContext)
    served = server_args.get("version")
    if served and release_id(served) != release_id(version):
        raise UnsupportedLayoutError(
            f"the rollout runs SGLang {served}, this trainer has SGLang {version}: the replica reproduces "
            "the bytes of its own release only (post releases and local builds included); install the rollout's "
            f"SGLang release on the trainer (pip install 'sglang=={served}')"
        )
    _check_model_level(server_args, hf_config_dict(hf_config))


def server_args_field_names(version: str) -> frozenset[str]:
    """The ServerArgs fields of the installed SGLang release (imports SGLang)."""
    from sglang.srt.server_args import ServerArgs

    if _adapter_kind(version) == "runtime_context":
        from sglang.srt.arg_groups.arg_utils import record_fields

        return frozenset(f.name for f in record_fields(ServerArgs))
    return frozenset(f.name for f in dataclasses.fields(ServerArgs))


def plan_fingerprint(server_args: Mapping[str, Any], field_names: frozenset[str] | set[str]) -> str:
    """Digest of the server args a rank context hands SGLang (its ServerArgs fields, instance fields left out)."""
    return server_args_fingerprint(
        {**_sglang_field_values(server_args, set(field_names)), **rollout_environment(server_args)}
    )


class RankContext:
    """SGLang's rank state for one rollout rank; `with ctx:` installs it (serialized, re-entrant)."""

    def __init__(self, server_args: Mapping[str, Any], layout: RankLayout, hf_config: Any):
        self.version = sglang_version()
        preflight(server_args, layout, hf_config, self.version)
        kind = _adapter_kind(self.version)
        self.layout = layout
        self.server_args_in = dict(server_args)
        self.config_dir = checkpoint_config_dir(hf_config_dict(hf_config))
        self.hybrid_linear_attention = hybrid_linear_attention(hf_config_dict(hf_config))
        self.environment = rollout_environment(server_args)
        self._installed = contextlib.ExitStack()  # what activation set, undone when the outermost `with` exits
        self._depth = 0
        with _LOCK:
            self._adapter = _GlobalsAdapter(self) if kind == "module_globals" else _RuntimeContextAdapter(self)
        self.server_args = self._adapter.server_args
        self.model_config = self._adapter.model_config

    @property
    def fingerprint(self) -> str:
        """Digest of the server args handed to SGLang (see `plan_fingerprint`)."""
        return server_args_fingerprint({**self._adapter.fields_used, **self.environment})

    @property
    def key(self) -> tuple:
        """Equal for ranks that hold equal bytes (same SGLang release, layout, relevant server args)."""
        return (release_id(self.version), self.layout.key, self.fingerprint)

    def __enter__(self) -> RankContext:
        _LOCK.acquire()
        try:
            if self._depth == 0:
                with contextlib.ExitStack() as installing:  # a failed activation undoes what it set
                    installing.enter_context(_rollout_environment_set(self.environment))
                    self._adapter.activate()
                    installing.callback(self._adapter.deactivate)
                    self._installed = installing.pop_all()
            self._depth += 1
        except BaseException:
            _LOCK.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._depth -= 1
            if self._depth == 0:
                self._installed.close()  # the adapter's state, then the environment
        finally:
            _LOCK.release()


def rank_context(server_args: Mapping[str, Any], layout: RankLayout, hf_config: Any) -> RankContext:
    """The rank state of rollout rank `layout.tp_rank`; use as `with rank_context(...) as ctx:`."""
    return RankContext(server_args, layout, hf_config)
