"""Produce one rollout rank's exact parameter bytes into transfer-buffer views, one parameter at a time.

The rank's model stays on `meta`. To load a parameter, its meta tensor is swapped for a typed view of the
destination bytes (`torch.utils.swap_tensors` keeps the Parameter object, so SGLang's `params_dict` and
`weight_loader` still find it), SGLang's own `load_weights` runs with that parameter's feeds, and the swap
is undone. Memory stays at the transfer buffers plus the HF tensors still awaited. A parameter larger
than a buffer slot is produced in byte ranges by replaying the recorded writes (`plan.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from verl_p2p.errors import ReplicaLoadError
from verl_p2p.planning.layout import RankLayout
from verl_p2p.replica.derived import post_load_skipped
from verl_p2p.replica.dtype_checks import _sglang_auto_dtype, check_auto_dtype, check_plan_dtypes  # noqa: F401
from verl_p2p.replica.plan import (
    HFSpecs,
    ParamPlan,
    WritePlan,
    build_meta_model,
    capture_write_plan,
    check_syncable,
)
from verl_p2p.replica.plan_cache import PlanCache, PlanKey, config_digest
from verl_p2p.replica.rank_context import (
    RankContext,
    hf_config_dict,
    installed_sglang_version,
    plan_fingerprint,
    preflight,
    release_id,
    server_args_field_names,
)

logger = logging.getLogger(__name__)


class CompletenessStager:
    """Holds arriving HF tensors until every parameter that needs them is complete and released.

    `offer` answers the parameters that just became complete (each once); fetch their inputs with
    `feeds(name)` and call `release(name)` once loaded (`take` does both). HF tensors no parameter of this
    rank needs are ignored; a tensor is dropped as soon as no pending or unreleased parameter needs it.
    """

    def __init__(self, plan: WritePlan):
        self._position = {name: i for i, name in enumerate(plan.params)}
        self._needs: dict[str, set[str]] = {name: set(p.feeds) for name, p in plan.params.items()}
        self._users: dict[str, set[str]] = {}
        for name, p in plan.params.items():
            for hf_name in p.feeds:
                self._users.setdefault(hf_name, set()).add(name)
        self._missing = {name: set(feeds) for name, feeds in self._needs.items() if feeds}
        self._complete: set[str] = set()
        self._held: dict[str, torch.Tensor] = {}
        self._offered: set[str] = set()

    def offer(self, hf_name: str, tensor: torch.Tensor) -> list[str]:
        """Take one HF tensor; return the parameters it completed (plan order)."""
        users = self._users.get(hf_name)
        if not users:
            return []
        if hf_name in self._offered:
            raise ReplicaLoadError(f"HF tensor {hf_name} was offered twice in one sync")
        self._offered.add(hf_name)
        self._held[hf_name] = tensor
        done = []
        for name in users:
            missing = self._missing.get(name)
            if missing is not None:
                missing.discard(hf_name)
                if not missing:
                    del self._missing[name]
                    self._complete.add(name)
                    done.append(name)
        return sorted(done, key=self._position.__getitem__)

    def pending(self) -> dict[str, set[str]]:
        """Parameters still waiting, with the HF tensors each is missing."""
        return {name: set(missing) for name, missing in self._missing.items()}

    def feeds(self, param_name: str) -> dict[str, torch.Tensor]:
        """The HF tensors of a complete, unreleased parameter (what `RankReplica.load` takes)."""
        if param_name not in self._complete:
            state = "still pending" if param_name in self._missing else "not complete or already released"
            raise ReplicaLoadError(f"parameter {param_name} is {state}: its feeds are not available")
        return {hf_name: self._held[hf_name] for hf_name in self._needs[param_name]}

    def release(self, param_name: str) -> None:
        """The parameter was loaded: drop the HF tensors nobody else still needs."""
        self._complete.discard(param_name)
        for hf_name in self._needs.get(param_name, ()):
            users = self._users[hf_name]
            if not any(u in self._missing or u in self._complete for u in users):
                self._held.pop(hf_name, None)

    def take(self, param_name: str) -> dict[str, torch.Tensor]:
        """`feeds` then `release`."""
        tensors = self.feeds(param_name)
        self.release(param_name)
        return tensors

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held.values())


@contextmanager
def _swapped(param: torch.nn.Parameter, view: torch.Tensor):
    """Make `param` (same Python object, same attributes) alias `view` for the duration."""
    stand_in = torch.Tensor._make_subclass(type(param), view, param.requires_grad)
    stand_in.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, stand_in)
    try:
        yield
    finally:
        torch.utils.swap_tensors(param, stand_in)


def _typed_view(dst: torch.Tensor, nbytes: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
        raise ReplicaLoadError(f"{what}: dst must be a contiguous 1-D uint8 tensor, got {dst.dtype} {tuple(dst.shape)}")
    if dst.numel() != nbytes:
        raise ReplicaLoadError(f"{what}: dst has {dst.numel()} bytes, the rollout rank holds {nbytes}")
    try:
        return dst.view(dtype)
    except RuntimeError as e:
        raise ReplicaLoadError(
            f"{what}: cannot view dst as {dtype} (align buffer slots to {dtype.itemsize} bytes): {e}"
        ) from e


def _contiguous_flat(t: torch.Tensor) -> torch.Tensor:
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1)


def _replay(
    chunk: torch.Tensor, c0: int, c1: int, off: int, shape: tuple, stride: tuple, src: torch.Tensor | None, fill
) -> None:
    """Apply one write (dst = param.as_strided(shape, stride, off)) restricted to elements [c0, c1)."""
    if any(s == 0 for s in shape):
        return
    extent = sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    lo, hi = off, off + extent + 1
    if hi <= c0 or lo >= c1:
        return
    if lo >= c0 and hi <= c1:
        target = chunk.as_strided(shape, stride, chunk.storage_offset() + off - c0)
        if src is None:
            target.fill_(fill)
        else:
            target.copy_(src)
        return
    d = max((i for i in range(len(shape)) if shape[i] > 1), key=lambda i: stride[i])
    st = stride[d]
    rest_shape = shape[:d] + shape[d + 1 :]
    rest_stride = stride[:d] + stride[d + 1 :]
    rest = sum((s - 1) * x for s, x in zip(rest_shape, rest_stride, strict=True))
    first = max(0, -(-(c0 - off - rest) // st))
    last = min(shape[d] - 1, (c1 - 1 - off) // st)
    full_a = max(first, -(-(c0 - off) // st))
    full_b = min(last, (c1 - 1 - off - rest) // st)
    if full_a <= full_b:
        n = full_b - full_a + 1
        sub = src.narrow(d, full_a, n) if src is not None else None
        target = chunk.as_strided(
            shape[:d] + (n,) + shape[d + 1 :], stride, chunk.storage_offset() + off + full_a * st - c0
        )
        if sub is None:
            target.fill_(fill)
        else:
            target.copy_(sub)
        edges = list(range(first, full_a)) + list(range(full_b + 1, last + 1))
    else:
        edges = list(range(first, last + 1))
    for i in edges:
        sub = src.select(d, i) if src is not None else None
        _replay(chunk, c0, c1, off + i * st, rest_shape, rest_stride, sub, fill)


@contextmanager
def _memoized_named_parameters(model: torch.nn.Module, memo: dict[tuple, list]) -> Iterator[None]:
    """SGLang's `load_weights` rebuilds `dict(self.named_parameters())` on every call; the replica calls it once
    per parameter, so that walk dominated a push (measured: 0.8 of 1.2 s CPU). The Parameter objects never
    change (swap_tensors keeps them), so one walk per distinct call signature serves every load."""
    original = type(model).named_parameters

    def named_parameters(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        key = (args, tuple(sorted(kwargs.items())))
        if key not in memo:
            memo[key] = list(original(model, *args, **kwargs))
        return iter(memo[key])

    model.named_parameters = named_parameters  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.named_parameters


@dataclass
class PlannedRank:
    """A rank's write plan, its replica key, and the SGLang state built to capture it (None when cached)."""

    plan: WritePlan
    key: tuple
    hf_config: dict
    from_cache: bool
    ctx: RankContext | None = None
    model: torch.nn.Module | None = None


def _server_args_fields(cache: PlanCache | None, version: str) -> frozenset[str]:
    """The release's ServerArgs field names: from `cache` when it holds them, else from SGLang (and kept there)."""
    fields = cache.server_args_fields(version) if cache is not None else None
    if fields is None:
        fields = server_args_field_names(version)
        if cache is not None:
            _try(cache.save_server_args_fields, version, fields)
    return fields


def replica_key(
    hf_config: dict | Any,
    server_args: Mapping[str, Any],
    layout: RankLayout,
    hf_specs: HFSpecs,
    cache: PlanCache | None = None,
) -> tuple:
    """The key of a rank's replica: equal keys hold equal bytes (SGLang release, layout, the server args SGLang
    is handed, HF config and tensors). `plan_rank` gives its plans this key; the trainer caches replicas by it."""
    hf = hf_config_dict(hf_config)
    version = installed_sglang_version()
    fingerprint = plan_fingerprint(server_args, _server_args_fields(cache, version))
    return (release_id(version), layout.key, fingerprint, config_digest(hf, hf_specs))


def plan_rank(
    hf_config: dict | Any,
    server_args: Mapping[str, Any],
    layout: RankLayout,
    hf_specs: HFSpecs,
    cache: PlanCache | None = None,
) -> PlannedRank:
    """The write plan of one rollout rank: loaded from `cache` (no SGLang import), else captured (and cached)."""
    hf = hf_config_dict(hf_config)
    version = installed_sglang_version()
    preflight(server_args, layout, hf, version)
    digest = config_digest(hf, hf_specs)
    if cache is None:
        ctx = RankContext(server_args, layout, hf)
        model = build_meta_model(ctx)
        plan = capture_write_plan(ctx, model, hf_specs)
        key = (release_id(version), layout.key, ctx.fingerprint, digest)
        return PlannedRank(plan, key, hf, from_cache=False, ctx=ctx, model=model)
    fingerprint = plan_fingerprint(server_args, _server_args_fields(cache, version))
    key = (release_id(version), layout.key, fingerprint, digest)
    plan_key = PlanKey(version, digest, layout, fingerprint)
    plan = cache.load(plan_key)
    if plan is not None:
        return PlannedRank(plan, key, hf, from_cache=True)
    ctx = RankContext(server_args, layout, hf)
    if ctx.fingerprint != fingerprint:
        raise ReplicaLoadError(
            f"p2p plan cache: the server-args fingerprint differs from the rank context's (SGLang {version}); "
            f"delete {cache.directory} and report this"
        )
    model = build_meta_model(ctx)
    plan = capture_write_plan(ctx, model, hf_specs)
    _try(cache.save, plan_key, plan)
    return PlannedRank(plan, key, hf, from_cache=False, ctx=ctx, model=model)


def _try(save, *args) -> None:
    """A cache write that fails (read-only or full disk) costs a capture next time, never the sync."""
    try:
        save(*args)
    except OSError as exc:
        logger.warning("p2p plan cache: could not write an entry (%s); continuing without it", exc)


# SGLang's `--dtype` spellings of the floating types (`auto` resolves from the checkpoint's config)
def check_chunk(p: ParamPlan, byte_offset: int, nbytes: int) -> int:
    """Refuse a byte range that is not whole elements inside the parameter; returns the element size."""
    es = p.dtype.itemsize
    if byte_offset % es or nbytes % es or byte_offset < 0 or byte_offset + nbytes > p.nbytes:
        raise ReplicaLoadError(
            f"{p.name}: chunk [{byte_offset}, +{nbytes}) is not element-aligned inside {p.nbytes} bytes"
        )
    return es


class RankReplica:
    """HF tensors -> the exact bytes one SGLang rollout rank holds, through SGLang's own model and loaders.

    The rank context and the meta model are built on first use: with a cached plan, nothing of SGLang is
    imported or built until something calls SGLang (the reference executor `load`, or `ctx`).
    """

    def __init__(
        self,
        server_args: Mapping[str, Any],
        layout: RankLayout,
        hf_config: Mapping[str, Any],
        plan: WritePlan,
        key: tuple,
        ctx: RankContext | None = None,
        model: torch.nn.Module | None = None,
    ):
        self.server_args = dict(server_args)
        self._layout = layout
        self.hf_config = dict(hf_config)
        self.plan = plan
        self.key = key
        self._ctx = ctx
        self._model = model
        self._param_objects: dict[str, torch.nn.Parameter] | None = None
        self._named_memo: dict[tuple, list] = {}
        self._lazy = threading.Lock()  # one context / model per replica, whichever thread asks first

    @classmethod
    def build(
        cls,
        hf_config: dict | Any,
        server_args: Mapping[str, Any],
        layout: RankLayout,
        hf_specs: HFSpecs,
        cache: PlanCache | None = None,
    ) -> RankReplica:
        """The rank's replica, its write plan from `cache` when held there, else captured on a meta model.

        Rejects layouts and models it cannot reproduce, before and after capture.
        """
        planned = plan_rank(hf_config, server_args, layout, hf_specs, cache)
        check_syncable(planned.plan)
        check_plan_dtypes(planned.plan, server_args, planned.hf_config)
        return cls(
            server_args, layout, planned.hf_config, planned.plan, planned.key, ctx=planned.ctx, model=planned.model
        )

    @property
    def ctx(self) -> RankContext:
        """The rank's SGLang state (built on first use)."""
        with self._lazy:
            if self._ctx is None:
                ctx = RankContext(self.server_args, self._layout, self.hf_config)
                if ctx.key != self.key[:3]:
                    raise ReplicaLoadError(
                        f"the rank context of {self._layout} (SGLang {ctx.version}) does not match the plan's key "
                        f"{self.key[:3]}: the installed SGLang changed since the plan was made; rebuild the replica"
                    )
                self._ctx = ctx
            return self._ctx

    @property
    def model(self) -> torch.nn.Module:
        """The rank's SGLang model on `meta` (built on first use)."""
        ctx = self.ctx
        with self._lazy:
            if self._model is None:
                self._model = build_meta_model(ctx)
            return self._model

    @property
    def _params(self) -> dict[str, torch.nn.Parameter]:
        model = self.model
        with self._lazy:
            if self._param_objects is None:
                self._param_objects = dict(model.named_parameters())
            return self._param_objects

    @property
    def layout(self) -> RankLayout:
        return self._layout

    def stager(self) -> CompletenessStager:
        return CompletenessStager(self.plan)

    def _feeds(self, p: ParamPlan, hf_tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        missing = [n for n in p.feeds if n not in hf_tensors]
        if missing:
            raise ReplicaLoadError(f"{p.name} needs HF tensors {missing} that were not given")
        out = []
        for n in p.feeds:
            t = hf_tensors[n]
            shape = self.plan.hf_specs[n][0]
            if tuple(t.shape) != tuple(shape):
                raise ReplicaLoadError(f"HF tensor {n} has shape {tuple(t.shape)}, the plan was built for {shape}")
            out.append((n, t))
        return out

    def _plan(self, param_name: str) -> ParamPlan:
        try:
            return self.plan.params[param_name]
        except KeyError:
            raise ReplicaLoadError(f"{param_name} is not a parameter of rollout rank {self.layout.tp_rank}") from None

    def load(self, param_name: str, hf_tensors: Mapping[str, torch.Tensor], dst: torch.Tensor) -> None:
        """Fill `dst` (1-D uint8, exactly the parameter's bytes) with what the rollout rank holds."""
        p = self._plan(param_name)
        view = _typed_view(dst, p.nbytes, p.dtype, param_name).view(p.shape)
        if not p.feeds:  # only SGLang's constant fills write it: replay them
            self.load_chunk(param_name, {}, 0, dst)
            return
        feeds = self._feeds(p, hf_tensors)
        param = self._params[param_name]
        with self.ctx, torch.no_grad(), _swapped(param, view), _memoized_named_parameters(self.model, self._named_memo):
            with post_load_skipped(self.model):
                self.model.load_weights(iter(feeds))

    def chunks(self, param_name: str, max_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges (offset, nbytes) of at most `max_bytes`, cut at expert/row boundaries."""
        p = self._plan(param_name)
        es = p.dtype.itemsize
        unit = None
        for k in range(1, max(2, len(p.shape))):
            n = es
            for s in p.shape[k:]:
                n *= s
            if n <= max_bytes:
                unit = n
                break
        if unit is None:
            row = es
            for s in p.shape[max(1, len(p.shape) - 1) :]:
                row *= s
            raise ReplicaLoadError(
                f"{param_name}: one row ({row} bytes) exceeds max_bytes={max_bytes}; use larger buffer slots"
            )
        step = (max_bytes // unit) * unit
        return [(off, min(step, p.nbytes - off)) for off in range(0, p.nbytes, step)]

    def load_chunk(
        self, param_name: str, hf_tensors: Mapping[str, torch.Tensor], byte_offset: int, dst: torch.Tensor
    ) -> None:
        """Fill `dst` with bytes [byte_offset, byte_offset + dst.numel()) of the parameter, replaying the plan."""
        p = self._plan(param_name)
        es = check_chunk(p, byte_offset, dst.numel())
        if not p.replayable:
            ops = sorted({w.op for w in p.writes if not w.replayable})
            raise ReplicaLoadError(
                f"{param_name}: SGLang writes it with {ops}, which cannot be replayed by byte range; "
                "use buffer slots of at least its size"
            )
        feeds = dict(self._feeds(p, hf_tensors))
        chunk = _typed_view(dst, dst.numel(), p.dtype, param_name)
        c0, c1 = byte_offset // es, (byte_offset + dst.numel()) // es
        flat = {}
        with torch.no_grad():
            for w in p.writes:
                src = None
                if w.op == "copy":
                    s = w.source
                    if s.hf_name not in flat:
                        flat[s.hf_name] = _contiguous_flat(feeds[s.hf_name])
                    base = flat[s.hf_name] if s.dtype is None else flat[s.hf_name].view(s.dtype)  # bits, as read
                    src = base.as_strided(s.shape, s.stride, base.storage_offset() + s.offset).expand(w.shape)
                _replay(chunk, c0, c1, w.offset, w.shape, w.stride, src, w.fill_value)

    def write_plan_summary(self) -> dict[str, Any]:
        """Small, JSON-friendly description (for logs and the `plan` CLI)."""
        return {
            "rank": self.layout.tp_rank,
            "params": len(self.plan.params),
            "nbytes": self.plan.nbytes,
            "hf_used": len(self.plan.used_hf_names),
            "hf_unused": len(self.plan.unused_hf_names),
        }


__all__ = [
    "CompletenessStager",
    "PlannedRank",
    "RankReplica",
    "ReplicaLoadError",
    "check_plan_dtypes",
    "plan_rank",
    "replica_key",
]
