"""The derived tensors p2p can sync: those SGLang rebuilds at session end from parameters p2p writes.

Some model classes compute non-parameter tensors from their loaded weights (`post_load_weights`). A rollout
publishes only its parameters, so after a p2p sync such a tensor is right only if SGLang derives it again, from
inputs that are all published and written. SGLang does that at `/end_weight_update` (from 0.5.21) when the
session's bytes came from outside its loader. This is the allow-list of derivations known to qualify; a plan
whose derived tensors are not all on it is refused (`check_syncable`), and a rollout without sessions is
refused for any of them (`model_class.refuse_post_load_without_sessions`). Derivations known NOT to be redone
at session end (`NOT_REBUILT`, e.g. Gemma-style norms' gemma_weight) are refused with their evidence.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Derivation:
    """Tensors matching `pattern` are rebuilt by `hook` from the parameters `{prefix}.<input>` of their module."""

    what: str  # for messages
    pattern: re.Pattern[str]  # group "prefix": the module that holds the derived tensor and its inputs
    inputs: tuple[str, ...]  # parameter name prefixes under the module (every matching parameter is an input)
    hook: str
    loaders: tuple[str, ...]  # SGLang classes whose `hook` makes this derivation (in a model class's MRO)

    def input_params(self, derived: str, params: Iterable[str]) -> list[str]:
        """The parameters `derived` is computed from (empty when it is not this derivation's)."""
        match = self.pattern.match(derived)
        if match is None:
            return []
        heads = tuple(f"{match['prefix']}.{i}" for i in self.inputs)
        return [p for p in params if p.startswith(heads)]


# DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash (DeepseekV2WeightLoaderMixin.post_load_weights): MLA's absorbed
# projections, a reshape/transpose of the published kv_b_proj (and, for block-FP8 checkpoints, a dequant with
# its published scales), copied in place into the same tensors (`bind_or_assign`).
MLA_ABSORBED = Derivation(
    # FP8 checkpoints: kv_b_proj's weight and weight_scale_inv are dequantized first; off the block-FP8 GPU path
    # (CPU, per-tensor/per-channel FP8, DeepGEMM's BMM) the dequant also leaves scales w_scale / w_scale_k / _v
    what="MLA's absorbed projections w_kc/w_vc (and their FP8 scales w_scale*), rebuilt from kv_b_proj",
    pattern=re.compile(r"^(?P<prefix>.+\.self_attn)\.(w_kc|w_vc|w_scale|w_scale_k|w_scale_v)$"),
    inputs=("kv_b_proj.",),
    hook="post_load_weights",
    loaders=("DeepseekV2WeightLoaderMixin",),
)
DERIVATIONS: tuple[Derivation, ...] = (MLA_ABSORBED,)


@dataclass(frozen=True)
class NotRebuilt:
    """A derivation SGLang is known not to redo at session end: refused, with the evidence (`why`)."""

    what: str
    pattern: re.Pattern[str]
    why: str


# Qwen3-Next (and the Qwen3.5 hybrids): GemmaRMSNorm keeps a buffer gemma_weight = weight + 1, set by the norm's
# own weight loader (SGLang 0.5.21 and 0.5.23 layers/layernorm.py GemmaRMSNorm._weight_loader; 0.5.23 through
# refresh_gemma_weight). /end_weight_update runs only the model's post_load_weights (these classes have none)
# and the quant methods' process_weights_after_loading (a norm has none); the only other refresh is the
# presharded loader's _rebind_parameter_aliases. A p2p write leaves it at the old weight + 1, and a buffer is
# not published for writing (SGLang registers named_parameters only).
GEMMA_NORM = NotRebuilt(
    what="GemmaRMSNorm's gemma_weight (its weight + 1)",
    pattern=re.compile(r"^.+\.gemma_weight$"),
    why="the norm's weight loader computes it, and SGLang's /end_weight_update (0.5.21, 0.5.23) never re-runs a "
    "weight loader: it runs only the model's post_load_weights and the quant methods' post-processing",
)
NOT_REBUILT: tuple[NotRebuilt, ...] = (GEMMA_NORM,)


def known_not_rebuilt(derived: Iterable[str]) -> dict[str, list[str]]:
    """Derived tensors of a known derivation a session end does not redo: {evidence: names}."""
    found: dict[str, list[str]] = {}
    for name in derived:
        for d in NOT_REBUILT:
            if d.pattern.match(name):
                found.setdefault(f"{d.what}: {d.why}", []).append(name)
    return found


def derivation_of(derived: str, params: Iterable[str]) -> tuple[Derivation, list[str]] | None:
    """The allow-listed derivation of tensor `derived` and its input parameters, or None."""
    params = list(params)
    for d in DERIVATIONS:
        inputs = d.input_params(derived, params)
        if inputs:
            return d, inputs
    return None


def derivations_of_class(cls: type) -> list[Derivation]:
    """The allow-listed derivations SGLang model class `cls` makes after loading (by its MRO)."""
    bases = {b.__name__ for b in cls.__mro__}
    return [d for d in DERIVATIONS if bases & set(d.loaders)]


def unexplained(derived: Mapping[str, frozenset[str]], param_feeds: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Derived tensors (-> the HF tensors their data came from) that no allow-listed derivation explains,
    each with why: no derivation of that name, or data from HF tensors none of its input parameters take."""
    problems = {}
    for name, origins in derived.items():
        found = derivation_of(name, param_feeds)
        if found is None:
            problems[name] = "no allow-listed derivation builds it"
            continue
        _, inputs = found
        fed = {f for p in inputs for f in param_feeds[p]}
        outside = sorted(set(origins) - fed)
        if outside:
            problems[name] = f"it is also computed from {outside[:3]}, which its inputs {inputs} do not take"
    return problems


def forget_derived(model: torch.nn.Module) -> None:
    """Drop the allow-listed derived tensors a capture left on the (meta) model, as SGLang's init leaves them
    (None). One may alias its input parameter (MLA's w_vc with one head per rank is a view of kv_b_proj), and
    a parameter referenced by a view cannot be swapped for a replay's destination."""
    params = [n for n, _ in model.named_parameters()]
    for module_name, module in model.named_modules():
        for attr, t in list(vars(module).items()):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                if derivation_of(f"{module_name}.{attr}", params) is not None:
                    setattr(module, attr, None)


@contextmanager
def post_load_skipped(model: torch.nn.Module) -> Iterator[None]:
    """While replaying SGLang's loader for one parameter's bytes, skip the allow-listed derivations (they write
    no parameter; the rollout runs them at session end): they would rebuild tensors from a partial load."""
    hook = derivations_of_class(type(model))
    if not hook or "post_load_weights" in vars(model):
        yield
        return
    model.post_load_weights = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del model.post_load_weights
