"""Capture a few decoder layers and name the rest: what makes a cold `verl-p2p plan` take seconds.

A rollout rank's write plan repeats itself layer by layer: every decoder layer of one kind (dense MLP or MoE,
decided by the config as SGLang's model class decides it) holds the same parameters with the same bytes, only
the layer index in their names (and in the HF names feeding them) differs. So the plan's (name, bytes, feeds)
of a deep model are those of a short copy of it (its first layers, until every kind has appeared once) with
each later layer renamed from the captured layer of its kind. Model types whose layer kinds are not listed
here are captured whole. `tests/test_plan_fast.py` proves the expansion equal to a full capture.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_p2p.planning.hf_names import layer_of

_MLA_FAMILY = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite")


def layer_kinds(cfg: Mapping[str, Any]) -> list[str] | None:
    """Each decoder layer's kind ("dense" / "moe") as SGLang's model class builds it, or None where unknown."""
    layers = int(cfg.get("num_hidden_layers") or 0)
    kind = cfg.get("model_type")
    if kind == "qwen3_moe":  # sglang/srt/models/qwen3_moe.py: mlp_only_layers and decoder_sparse_step
        only = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step") or 1)
        experts = int(cfg.get("num_experts") or 0)
        return ["moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(layers)]
    if kind in _MLA_FAMILY:  # sglang/srt/models/deepseek_v2.py `_is_layer_sparse` (glm4_moe's is the same rule)
        first = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        experts = int(cfg.get("n_routed_experts") or 0)
        return ["moe" if experts and i >= first and i % freq == 0 else "dense" for i in range(layers)]
    return None


@dataclass(frozen=True)
class LayerSample:
    """The first `kept` layers stand for all `layers`: layer i is captured layer `source[i]`."""

    layers: int
    kept: int
    source: tuple[int, ...]

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> LayerSample | None:
        """The sample of this config, or None when the whole model must be captured (unknown kinds, shallow)."""
        kinds = layer_kinds(cfg)
        if not kinds:
            return None
        first: dict[str, int] = {}
        for i, k in enumerate(kinds):
            first.setdefault(k, i)
        kept = max(first.values()) + 1
        if kept >= len(kinds):
            return None
        return cls(len(kinds), kept, tuple(i if i < kept else first[k] for i, k in enumerate(kinds)))

    def config(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The short copy of `cfg` that is captured."""
        short = dict(cfg, num_hidden_layers=self.kept)
        if "max_window_layers" in short:
            short["max_window_layers"] = min(int(short["max_window_layers"]), self.kept)
        return short

    def covers(self, names: Iterable[str]) -> bool:
        """Whether every layered HF name is one of the model's decoder layers (a checkpoint's extra layer, such as
        a multi-token-prediction one, is captured whole instead)."""
        return all((j := layer_of(n)) is None or j < self.layers for n in names)

    def keeps(self, hf_name: str) -> bool:
        layer = layer_of(hf_name)
        return layer is None or layer < self.kept

    def specs(self, specs: Mapping[str, Any]) -> dict[str, Any]:
        """The HF tensors of the short copy."""
        return {n: v for n, v in specs.items() if self.keeps(n)}

    def whole_bytes(self, nbytes: Mapping[str, int]) -> int:
        """The whole model's bytes from the short copy's {HF name: bytes}: each captured layer counted once per
        layer it stands for."""
        counts: dict[int, int] = {}
        for j in self.source:
            counts[j] = counts.get(j, 0) + 1
        return sum(n * (1 if (j := layer_of(name)) is None else counts.get(j, 0)) for name, n in nbytes.items())

    def expand(self, params: Iterable[tuple[str, int, Sequence[str]]]) -> list[tuple[str, int, tuple[str, ...]]]:
        """The short copy's (name, bytes, feeds) -> the whole model's, each layer renamed from its captured one."""
        by_source: dict[int, list[int]] = {}
        for i, j in enumerate(self.source):
            by_source.setdefault(j, []).append(i)
        out = []
        for name, nbytes, feeds in params:
            j = layer_of(name)
            if j is None:
                out.append((name, nbytes, tuple(feeds)))
                continue
            for i in by_source.get(j, ()):
                out.append((_rename(name, j, i), nbytes, tuple(_rename(f, j, i) for f in feeds)))
        return out


def _rename(name: str, old: int, new: int) -> str:
    layer = layer_of(name)
    if layer is None:
        return name
    if layer != old:
        raise ValueError(f"{name}: fed across decoder layers, so its layer cannot be renamed")
    return name.replace(f"model.layers.{old}.", f"model.layers.{new}.", 1)
