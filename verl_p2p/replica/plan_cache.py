"""Write plans on disk, so a restarted trainer reuses them instead of capturing them again.

A plan depends on the SGLang release, the HF config and tensor list (the config digest), the rank's layout
and the server args SGLang is handed; the entry's name is a digest of exactly those (`PlanKey`), and the
entry repeats the key so a collision or a stray file is never taken for a match. Entries are written
atomically (temporary file + rename: concurrent writers of one key are harmless) and carry a checksum of
their body; an entry that cannot be read, fails its checksum or does not match its key is logged and
captured again. Entries are plain JSON (no pickle: loading an entry runs no code).

Which server args SGLang is handed depends on the release's ServerArgs fields; their names are kept per
release in the same directory, so a cached plan is found without importing SGLang at all. The key also holds a
digest of the capture code itself, so a changed recorder never reuses an entry written by an older one, and the
host it was captured on (`host_identity`: torch build, platform, the `SGLANG_*` environment SGLang reads at
import, a digest of the installed SGLang files), so a directory shared by nodes of different kinds (an NFS
home) never serves one kind's plan to another, nor a patched SGLang build the plan of the stock one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import stat
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_p2p.errors import P2PConfigError
from verl_p2p.planning.layout import RankLayout
from verl_p2p.replica.plan import HFSpecs, ParamPlan, RecordedWrite, SourceView, WritePlan

logger = logging.getLogger(__name__)

_CAPTURE_CODE = (
    "plan.py",
    "plan_checks.py",
    "plan_types.py",
    "plan_cache.py",
    "rank_context.py",
    "rank_adapters.py",
    "rank_groups.py",
    "stream.py",
    "dtype_checks.py",
    "fp8.py",  # the rank's quant config
)
# environment prefixes SGLang reads (at import and while building a model): e.g. SGLANG_USE_CPU_ENGINE pads the
# vocabulary differently, SGLANG_USE_AITER changes MoE layouts on ROCm
_SGLANG_ENV_PREFIXES = ("SGLANG_", "SGL_")
# HF config entries that name where a config came from, not what the model is
_CONFIG_PROVENANCE = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


def _sglang_environment() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_SGLANG_ENV_PREFIXES)}


# Taken when this module is imported (before the replica imports SGLang): SGLang itself sets some of these while
# it resolves server args (0.5.23: SGLANG_ENABLE_TORCH_COMPILE, ...), which would make every later key differ
# from a fresh process's. What SGLang sets there follows from the server args, which the key holds already.
_SGLANG_ENV = _sglang_environment()


@functools.cache
def capture_code_digest() -> str:
    """Digest of the modules that capture, store and key plans: any change to them makes older entries miss.
    Memoized per process (`functools.cache`): the code a process runs does not change under it."""
    h = hashlib.sha256()
    for name in _CAPTURE_CODE:
        h.update((Path(__file__).with_name(name)).read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def _tree_digest(root: str) -> str:
    """Digest of the Python files under `root` (names and contents), memoized per process and directory: an
    installed package is not replaced under a running process, and hashing SGLang's files is slow."""
    h = hashlib.sha256()
    base = Path(root)
    for path in sorted(base.rglob("*.py")):
        h.update(f"\n{path.relative_to(base).as_posix()}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:32]


def sglang_install_digest() -> str:
    """Digest of the installed SGLang package's Python files (names and contents), without importing SGLang.

    Two builds with one `__version__` (a patched install, a fork) load weights differently; this tells them
    apart. Computed once per process and package directory (`_tree_digest`)."""
    module = sys.modules.get("sglang")
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None:
        spec = importlib.util.find_spec("sglang")
        origin = spec.origin if spec is not None else None
    if origin is None:
        return "absent"
    return _tree_digest(str(Path(origin).parent))


def host_identity() -> str:
    """What of the capturing host a plan's bytes may depend on, as canonical JSON.

    The torch build (version, CUDA/HIP), the platform, whether a GPU is visible, every `SGLANG_*`/`SGL_*`
    environment value (as the process had them when this module was imported) and the SGLang install digest.
    Anything unlisted here that changed a plan would be a defect of this key; the first push of each plan is
    checked against SGLang's loader (`verify_first_push`) all the same.
    """
    identity = {
        "torch": str(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "gpu": bool(torch.cuda.is_available()),
        "platform": f"{sys.platform}-{platform.machine()}",
        "python": platform.python_version(),
        "sglang_env": dict(_SGLANG_ENV),
        "sglang_install": sglang_install_digest(),
    }
    return json.dumps(identity, sort_keys=True)


def default_plan_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/verl_p2p/plans`, else `~/.cache/verl_p2p/plans`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "verl_p2p" / "plans"


def config_digest(hf_config: Mapping[str, Any], hf_specs: HFSpecs) -> str:
    """Digest of the HF config and the HF tensor list (names, shapes, dtypes, in checkpoint order).

    Where the config came from (`_name_or_path`, `transformers_version`) is left out: it changes no byte, and a
    moved checkpoint keeps its plans."""
    dtype_names: dict[torch.dtype, str] = {}
    relevant = {k: v for k, v in dict(hf_config).items() if k not in _CONFIG_PROVENANCE}
    h = hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode())
    for name, (shape, dtype) in hf_specs.items():
        dtype_name = dtype_names.get(dtype) or dtype_names.setdefault(dtype, str(dtype))
        h.update(f"\n{name}:{tuple(shape)}:{dtype_name}".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class PlanKey:
    """Everything a rank's write plan depends on."""

    sglang_version: str
    config_digest: str
    layout: RankLayout
    server_args_fingerprint: str
    host: str = field(default_factory=host_identity)  # canonical JSON (`host_identity`)

    def as_json(self) -> dict:
        return {
            "capture_code": capture_code_digest(),
            "host": json.loads(self.host),
            "sglang_version": self.sglang_version,
            "config_digest": self.config_digest,
            "layout": {k: getattr(self.layout, k) for k in self.layout.__dataclass_fields__},
            "server_args_fingerprint": self.server_args_fingerprint,
        }

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()


_DTYPES: dict[str, torch.dtype] = {}


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r}")
        _DTYPES[name] = dtype
    return dtype


def plan_to_json(plan: WritePlan) -> dict:
    """A compact JSON form: HF tensors listed once, referred to by index."""
    index = {name: i for i, name in enumerate(plan.hf_specs)}

    def write(w: RecordedWrite) -> list:
        s = w.source
        source = None if s is None else [index[s.hf_name], s.offset, list(s.shape), list(s.stride)]
        if s is not None and s.dtype is not None:
            source.append(dtype_name(s.dtype))
        return [w.op, w.offset, list(w.shape), list(w.stride), source, w.fill_value, [index[f] for f in w.feeds]]

    dtype_names: dict[torch.dtype, str] = {}

    def dtype_name(dtype: torch.dtype) -> str:
        return dtype_names.get(dtype) or dtype_names.setdefault(dtype, str(dtype).removeprefix("torch."))

    return {
        "hf": [[n, list(shape), dtype_name(dtype)] for n, (shape, dtype) in plan.hf_specs.items()],
        "params": [
            [
                p.name,
                list(p.shape),
                dtype_name(p.dtype),
                p.nbytes,
                [index[f] for f in p.feeds],
                [write(w) for w in p.writes],
            ]
            for p in plan.params.values()
        ],
        "derived": list(plan.derived),
        "local": list(plan.local),
    }


def plan_from_json(data: Mapping[str, Any]) -> WritePlan:
    """Inverse of `plan_to_json` (HF names are shared string objects, not copies per use)."""
    names = [str(n) for n, _, _ in data["hf"]]
    hf_specs = {name: (tuple(shape), _dtype(dtype)) for name, shape, dtype in data["hf"]}
    if list(hf_specs) != names:
        raise ValueError("duplicate HF tensor names")

    def write(raw: list) -> RecordedWrite:
        op, offset, shape, stride, source, fill_value, feeds = raw
        view = None
        if source is not None:
            reinterpreted = _dtype(source[4]) if len(source) > 4 else None
            view = SourceView(names[source[0]], source[1], tuple(source[2]), tuple(source[3]), reinterpreted)
        return RecordedWrite(
            op=op,
            offset=offset,
            shape=tuple(shape),
            stride=tuple(stride),
            source=view,
            fill_value=fill_value,
            feeds=tuple(names[i] for i in feeds),
        )

    params = {}
    for name, shape, dtype, nbytes, feeds, writes in data["params"]:
        params[name] = ParamPlan(
            name=name,
            shape=tuple(shape),
            dtype=_dtype(dtype),
            nbytes=nbytes,
            feeds=tuple(names[i] for i in feeds),
            writes=tuple(write(w) for w in writes),
        )
    return WritePlan(
        params=params,
        hf_specs=hf_specs,
        derived=tuple(data.get("derived", ())),
        local=tuple(data.get("local", ())),
    )


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except FileNotFoundError:
            pass
        raise


def read_entry(path: str | os.PathLike) -> tuple[dict, WritePlan]:
    """(key as JSON, plan) of one cache entry, checksum verified; for carrying plans to a host without SGLang."""
    header_line, body = Path(path).read_text().split("\n", 1)
    header = json.loads(header_line)
    if header.get("sha256") != hashlib.sha256(body.encode()).hexdigest():
        raise ValueError(f"{path}: checksum mismatch (truncated or modified)")
    return header["key"], plan_from_json(json.loads(body))


def _foreign(st: os.stat_result) -> str | None:
    """Why a file or directory with this status may hold what another user wrote, or None."""
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def ensure_private_directory(directory: Path) -> None:
    """Create `directory` (mode 0700) if it is missing; refuse one another user could write into.

    An entry's checksum proves integrity, not authorship: a cached plan decides which rollout parameters are
    never written (`local`, counted as covered) and which are derived, and nothing re-checks those lists. So the
    cache is trusted only where nobody but this user can plant or change an entry. A directory that cannot be
    created is left to `save` (an unwritable cache costs a capture, not the run)."""
    try:
        if not directory.exists():
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir(mode=0o700, exist_ok=True)
        st = directory.stat()
    except OSError as exc:
        logger.warning("p2p plan cache: cannot create %s (%s); plans will be captured, not cached", directory, exc)
        return
    why = "not a directory" if not stat.S_ISDIR(st.st_mode) else _foreign(st)
    if why is not None:
        raise P2PConfigError(
            f"plan_cache_dir {directory} is {why}: another user could plant write plans there that make p2p skip "
            f"parameters silently. Fix: `chmod 700 {directory}` if it is yours, or set engine_kwargs.verl_p2p."
            "plan_cache_dir to a directory only you can write (it is created with mode 0700), or to '' (no cache)"
        )


class PlanCache:
    """A directory of write plans, one file per `PlanKey`, that only this user can write
    (`ensure_private_directory`, checked when the cache is opened)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        ensure_private_directory(self.directory)

    @classmethod
    def from_option(cls, option: str | None) -> PlanCache | None:
        """`plan_cache_dir` semantics: None -> the default directory, "" -> no cache."""
        if option is None:
            return cls(default_plan_cache_dir())
        if option == "":
            return None
        return cls(os.path.expanduser(option))

    def path(self, key: PlanKey) -> Path:
        version = "".join(c if c.isalnum() or c in ".-" else "_" for c in key.sglang_version)
        return self.directory / f"plan-sglang{version}-{key.digest[:32]}.json"

    def load(self, key: PlanKey) -> WritePlan | None:
        """The cached plan of `key`, or None (missing; unreadable, corrupt or foreign entries are logged)."""
        path = self.path(key)
        try:
            with open(path) as f:
                foreign = _foreign(os.fstat(f.fileno()))
                text = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("p2p plan cache: cannot read %s (%s); capturing the plan again", path, exc)
            return None
        if foreign is not None:
            logger.warning("p2p plan cache: ignoring %s, %s; capturing the plan again", path, foreign)
            return None
        try:
            header_line, body = text.split("\n", 1)
            header = json.loads(header_line)
            if header.get("key") != key.as_json():
                raise ValueError("the entry was written for another key")
            if header.get("sha256") != hashlib.sha256(body.encode()).hexdigest():
                raise ValueError("checksum mismatch (truncated or modified)")
            return plan_from_json(json.loads(body))
        except Exception as exc:  # any defect of the file means: capture again
            logger.warning("p2p plan cache: ignoring corrupt entry %s (%s); capturing the plan again", path, exc)
            return None

    def save(self, key: PlanKey, plan: WritePlan) -> Path:
        body = json.dumps(plan_to_json(plan), separators=(",", ":"))
        header = {"key": key.as_json(), "sha256": hashlib.sha256(body.encode()).hexdigest()}
        path = self.path(key)
        _atomic_write(path, json.dumps(header, sort_keys=True) + "\n" + body)
        return path

    # ---- the ServerArgs field names of an SGLang release (to compute the key without importing SGLang) ----

    def _fields_path(self, version: str) -> Path:
        safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in version)
        return self.directory / f"server_args_fields-sglang{safe}.json"

    def server_args_fields(self, version: str) -> frozenset[str] | None:
        path = self._fields_path(version)
        try:
            data = json.loads(path.read_text())
            if data.get("sglang_version") != version or not isinstance(data.get("fields"), list):
                raise ValueError("not a field list of this release")
            return frozenset(str(f) for f in data["fields"])
        except FileNotFoundError:
            return None
        except Exception as exc:
            logger.warning("p2p plan cache: ignoring unreadable %s (%s)", path, exc)
            return None

    def save_server_args_fields(self, version: str, fields: frozenset[str]) -> None:
        text = json.dumps({"sglang_version": version, "fields": sorted(fields)})
        _atomic_write(self._fields_path(version), text)


__all__ = [
    "PlanCache",
    "PlanKey",
    "config_digest",
    "default_plan_cache_dir",
    "host_identity",
    "read_entry",
    "sglang_install_digest",
]
