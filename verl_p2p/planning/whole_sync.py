"""The whole sync, not only the wire: export, conversion, staging, wire, p2p's fixed push cost, the control
plane's HTTP steps per engine, the pause, verl's own timer around it, and the first sync's extra preparation.

Parts that pipeline (conversion + staging against the wire) count once as the larger; the others add. The
rates are `plan_rates.Rates` (committed JSON, each figure naming its source run).
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_p2p.planning.plan_rates import Rates

TCP_ONE_HOST = "tcp-one-host"


@dataclass(frozen=True)
class Link:
    """How bytes travel: Mooncake tcp through one host's loopback, or RDMA at `gbits` Gb/s per GPU."""

    kind: str
    gbits: float | None = None

    def describe(self) -> str:
        return TCP_ONE_HOST if self.kind == "tcp" else f"rdma:{self.gbits:g}"


def parse_link(text: str) -> Link:
    """`tcp-one-host` or `rdma:N` (N Gb/s per GPU); ValueError naming the forms otherwise."""
    text = text.strip()
    if text == TCP_ONE_HOST:
        return Link("tcp")
    kind, _, value = text.partition(":")
    try:
        gbits = float(value)
    except ValueError:
        gbits = 0.0
    if kind != "rdma" or gbits <= 0:
        raise ValueError(f"--link {text!r}: give {TCP_ONE_HOST} or rdma:N (N Gb/s per GPU, e.g. rdma:400)")
    return Link("rdma", gbits)


FSDP_GATHERS_NOT_COUNTED = (
    "an FSDP trainer's full-tensor all-gathers over its ranks' links (each rank gathers the whole model): no "
    "multi-GPU run measures their rate yet"
)


@dataclass(frozen=True)
class WholeSync:
    """Seconds per part of one steady sync, what the first sync adds, and what no measured rate covers yet."""

    parts: dict[str, float]
    paused_s: float
    verl_sync_s: float
    first_extra_s: float
    not_counted: tuple[str, ...] = ()

    @property
    def bound(self) -> str:
        return max(self.parts, key=self.parts.__getitem__)

    def json(self) -> dict:
        return {
            "parts_s": self.parts,
            "bound": self.bound,
            "steady_paused_s": self.paused_s,
            "steady_verl_sync_s": self.verl_sync_s,
            "first_sync_extra_s": self.first_extra_s,
            "first_sync_total_s": self.paused_s + self.first_extra_s,
            "not_counted": list(self.not_counted),
        }

    def text(self) -> str:
        parts = " + ".join(f"{k} {v:.3f}" for k, v in self.parts.items())
        missing = "".join(f"; not counted: {what}" for what in self.not_counted)
        return (
            f"whole sync (steady): {parts} -> paused {self.paused_s:.3f} s ({self.bound}-bound); verl's "
            f"update_weights ~{self.verl_sync_s:.3f} s; the first sync adds {self.first_extra_s:.1f} s before the "
            f"pause{missing}"
        )


def predict_whole(
    rates: Rates,
    source_bytes: int,
    source_tensors: int,
    link: Link,
    trainer_kind: str = "megatron",
    fp8: bool = False,
    engines: int = 1,
    layout_wire_s: float | None = None,
) -> WholeSync:
    """One source's bytes and HF tensors (the slowest source's); `layout_wire_s`: the layout estimate's
    predicted wire (with its conversion pipelining) for an RDMA link, which replaces bytes / NIC."""
    convert = source_bytes / ((rates.fp8_convert_gbps if fp8 else rates.convert_gbps) * 1e9)
    if link.kind == "tcp":  # pinned host slots staged from the GPU, written through the host's TCP stack
        stage = source_bytes / (rates.staging_gbps * 1e9)
        wire = source_bytes / (rates.tcp_one_host_gbps * 1e9)
    else:  # GPU slots registered with the NIC: no staging
        stage = 0.0
        wire = layout_wire_s if layout_wire_s is not None else source_bytes / (link.gbits * 1e9 / 8)
    parts = {
        "export": source_tensors * rates.export_per_tensor_s,
        "convert+stage (hidden under wire)" if convert + stage < wire else "convert+stage": convert + stage,
        "wire": wire,
        "push_fixed": rates.push_fixed_s + (rates.push_extra_s_fsdp if trainer_kind == "fsdp" else 0.0),
        "control_plane": rates.control_per_engine_s * engines,
    }
    overlapped = max(wire, convert + stage)
    paused = parts["export"] + overlapped + parts["push_fixed"] + parts["control_plane"]
    overhead = rates.verl_overhead_s.get(trainer_kind, rates.verl_overhead_s["megatron"])
    verl = paused - parts["control_plane"] + overhead  # verl's timer: p2p's push plus its own overhead
    not_counted = (FSDP_GATHERS_NOT_COUNTED,) if trainer_kind == "fsdp" else ()
    return WholeSync(parts, paused, verl, rates.first_prepare_s, not_counted)
