"""One witness build per SGLang release per test session, shared by every replica-exact module.

A module declares its witnessed jobs at import (`declare`); the first test that needs a release builds the jobs of
every declared module for it at once: each checkpoint written once, one group of witness processes (so SGLang is
imported once per rank per release, the build's main cost), one comparison run. The build lives in a per-session
folder both pytest-xdist workers see, behind a file lock per release, so the other worker reuses it (or builds
another release meanwhile) instead of paying again. Witnesses of identical jobs (same checkpoint, server args and
environment) are built once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from support import replica_harness as harness

BUILD_TIMEOUT_S = 1800  # the witness group of one release, every module's jobs (a loaded 2-core host)


@dataclass(frozen=True)
class Checkpoint:
    """A tiny checkpoint (`sandbox/tiny.py`) written once per session; `fp8`: the rollout loads the trainer's
    block-FP8 files quantized from it, and the replica is fed the tiny (bf16) tensors through the quantize step."""

    arch: str
    dtype: str = "float32"
    id_encoded: bool = True
    overrides: tuple = ()
    fp8: bool = False

    @classmethod
    def of(cls, arch: str, dtype: str = "float32", id_encoded: bool = True, fp8: bool = False, **overrides):
        return cls(arch, dtype, id_encoded, tuple(sorted(overrides.items())), fp8)

    @property
    def key(self) -> str:
        return _digest(self.__dict__)

    def write(self, root: Path) -> tuple[str, str | None]:
        """(model path, bf16 source or None), written under root once (atomically: a rename)."""
        import torch

        from verl_p2p.sandbox.tiny import write_tiny_checkpoint
        from verl_p2p.trainer.fp8_checkpoint import quantize_checkpoint

        base = root / self.key
        if not base.exists():
            tmp = root / f"{self.key}.tmp{os.getpid()}"
            src = write_tiny_checkpoint(
                tmp / "src", self.arch, self.id_encoded, dtype=getattr(torch, self.dtype), **dict(self.overrides)
            )
            if self.fp8:
                quantize_checkpoint(src, tmp / "fp8")
            try:
                os.replace(tmp, base)
            except OSError:  # the other worker wrote the same checkpoint first
                if not base.exists():
                    raise
                shutil.rmtree(tmp)
        return (str(base / "fp8"), str(base / "src")) if self.fp8 else (str(base / "src"), None)


@dataclass
class Job:
    """One witnessed layout: `tag` names it within its module; `options`: what replica_compare.py reads besides
    (e.g. strided_feeds, fusion_from_published, shared_tp1_from_published)."""

    tag: str
    checkpoint: Checkpoint
    server_args: dict
    env: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.server_args["tp_size"]

    @property
    def witness_key(self) -> str:
        return _digest([self.checkpoint.key, self.server_args, self.env])


@dataclass
class Matrix:
    """A module's declared jobs and releases; `result` / `witness_dir` build the release on first use."""

    name: str
    versions: tuple[str, ...]
    jobs: list[Job]
    session_dir: Path | None = None

    def prepare(self, session_dir: Path, versions=None) -> Matrix:
        """Builds (or waits for) the given releases (default: all of this module's): releases no other worker
        is building first, then those it is."""
        self.session_dir = session_dir
        todo = [v for v in (versions or self.versions) if v in self.versions]
        waiting = [v for v in todo if not _build(session_dir, v, block=False)]
        for v in waiting:
            _build(session_dir, v, block=True)
        return self

    def result(self, version: str, tag: str) -> dict:
        """The comparison of job `tag` under `version` (replica_compare.py's result)."""
        assert self.session_dir is not None, "prepare() first"
        results = _build(self.session_dir, version, block=True)
        return results[f"{self.name}:{tag}"]

    def witness_dir(self, version: str, tag: str) -> Path:
        """Where SGLang's ranks of job `tag` under `version` dumped rank{r}.pt / derived{r}.pt."""
        job = next(j for j in self.jobs if j.tag == tag)
        return self.session_dir / version / "out" / job.witness_key


MATRICES: dict[str, Matrix] = {}
ACTIVE: set[str] | None = None  # modules with selected tests (conftest sets it after collection); None: all


def declare(module: str, versions, jobs: list[Job]) -> Matrix:
    """Register a module's jobs (at import, so every worker knows every module's jobs before a build)."""
    tags = [j.tag for j in jobs]
    assert len(set(tags)) == len(tags), f"{module}: duplicate job tags"
    MATRICES[module] = Matrix(module, tuple(versions), jobs)
    return MATRICES[module]


def session_dir(tmp_path_factory) -> Path:
    """A folder of this test session that every pytest-xdist worker of it sees (the workers' base temp's parent)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "replica-witnesses"
    path.mkdir(exist_ok=True)
    return path


def needed_versions(request) -> set[str] | None:
    """The releases the selected tests of the requesting module take as their `version` parameter (so `-k 0.5.12`
    builds that release only); None (all) when one of them takes none."""
    versions: set[str] = set()
    for item in request.session.items:
        if item.module is request.module:
            params = getattr(item, "callspec", None)
            if params is None or "version" not in params.params:
                return None
            versions.add(params.params["version"])
    return versions


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


_DONE: dict[tuple[str, str], dict] = {}


def _build(root: Path, version: str, block: bool) -> dict | None:
    """The results of `version`'s build, building it under its lock if nobody has; None when `block` is off and
    another worker holds the lock."""
    if (str(root), version) in _DONE:
        return _DONE[str(root), version]
    with open(root / f"{version}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        done, failed = root / version / "results.json", root / f"{version}.error"
        if failed.exists():
            raise RuntimeError(f"SGLang {version} shared witness build failed earlier:\n{failed.read_text()}")
        if not done.exists():
            try:
                _build_version(root, version)
            except Exception as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
                raise
        results = {r["tag"]: r for r in json.loads(done.read_text())}
    _DONE[str(root), version] = results
    return results


def _build_version(root: Path, version: str) -> None:
    """Every active module's jobs for `version`: checkpoints, one witness group (largest worlds first, identical
    witnesses once), one comparison run; results.json is written last."""
    from support.replica_compare import compare_jobs

    matrices = [m for m in MATRICES.values() if version in m.versions and (ACTIVE is None or m.name in ACTIVE)]
    out, logs, ckpts = root / version / "out", root / version / "logs", root / "checkpoints"
    for d in (out, logs, ckpts):
        d.mkdir(parents=True, exist_ok=True)
    witnesses: dict[int, dict[str, dict]] = {}
    compares: dict[int, list[dict]] = {}
    for m in matrices:
        for job in m.jobs:
            model_path, bf16_source = job.checkpoint.write(ckpts)
            key = job.witness_key
            witness = {"tag": key, "model_path": model_path, "server_args": job.server_args, "env": job.env}
            witnesses.setdefault(job.world, {})[key] = witness
            compare = {**witness, **job.options, "tag": f"{m.name}:{job.tag}", "witness": key}
            if bf16_source is not None:
                compare["bf16_source"] = bf16_source
            compares.setdefault(job.world, []).append(compare)
    phases = [(w, list(witnesses[w].values())) for w in sorted(witnesses, reverse=True)]
    spec = harness.write_spec(root / version / "witness.json", phases, out)
    procs = harness.start_witnesses(version, spec, logs)
    harness.wait_all(procs, BUILD_TIMEOUT_S, f"SGLang {version} witnesses (logs: {logs})")
    compare_spec = root / version / "compare.json"
    compare_spec.write_text(
        json.dumps({"out": str(out), "phases": [{"world": w, "jobs": compares[w]} for w in sorted(compares)]})
    )
    if harness.SGLANG_DIRS[version] is None:  # the release installed in this process
        results = compare_jobs([compare_spec])
    else:
        proc, log = harness.start_compare(version, [compare_spec], logs)
        harness.wait_all([proc], BUILD_TIMEOUT_S, f"replica comparisons under SGLang {version}")
        results = harness.read_results(log)
    tmp = root / version / "results.json.tmp"
    tmp.write_text(json.dumps(results))
    os.replace(tmp, root / version / "results.json")
