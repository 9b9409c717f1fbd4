"""The rates a whole-sync prediction uses (the content of docs/measurements/plan_rates.json, each figure derived
from a committed measurement by `verl_p2p.cli.plan_rates_file.derive_rates`). No I/O here: the CLI reads the file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """The figures of plan_rates.json a prediction reads (seconds, GB/s of 1e9 bytes)."""

    tcp_one_host_gbps: float
    staging_gbps: float
    convert_gbps: float
    fp8_convert_gbps: float
    export_per_tensor_s: float
    push_fixed_s: float
    control_per_engine_s: float
    first_prepare_s: float
    push_extra_s_fsdp: float
    verl_overhead_s: dict[str, float]

    @classmethod
    def from_document(cls, data: dict) -> Rates:
        """From plan_rates.json's content (read by verl_p2p.cli.plan_rates_file)."""
        value = {k: v["value"] for k, v in data["rates"].items()}
        overhead = {k.removeprefix("verl_overhead_s_"): v for k, v in value.items() if k.startswith("verl_overhead")}
        plain = {k: v for k, v in value.items() if not k.startswith("verl_overhead")}
        return cls(**plain, verl_overhead_s=overhead)
