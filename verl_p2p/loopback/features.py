"""What the SGLang release a loopback engine claims to be (`sglang_version`) offers on its control plane.

The loopback imitates a release it is told to be, so here (and only here) behaviour follows the version
string. Cut-offs read from the sources of every release 0.5.12 .. 0.5.23 (docs/protocol.md): begin/end
weight-update sessions, the checker's `skip_tensor_list` / `selector`, and a rank dropping its snapshot
after a compare that passed, and checksum ranks whose `parallelism_info` is a list (one entry per
runner role: the target, then any draft), from 0.5.21; `allow_quant_error` from 0.5.15; per-GPU / per-engine checksums
from 0.5.13. `/weight_version` answers 404 ("deprecated, use /model_info") from 0.5.12 and is gone from 0.5.21.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_p2p.sglang_versions import CHECKER_QUANT_ERROR_SINCE, CHECKER_SKIP_LIST_SINCE, SESSIONS_SINCE, parse_release


def parse_version(text: str) -> tuple[int, int, int]:
    """`"0.5.12"`, `"0.5.23.post1"`, `"0.5.22rc0"` -> (0, 5, 12) ... (`sglang_versions.parse_release`, the one
    parser); raises ValueError on anything else: a loopback engine must be told a real release."""
    release = parse_release(text)
    if release is None:
        raise ValueError(f"not an SGLang version: {text!r}")
    return release


def installed_sglang_version() -> str:
    """The importable SGLang's version string."""
    from sglang.version import __version__

    return __version__


@dataclass(frozen=True)
class Features:
    """Control-plane features of one SGLang release."""

    version: str
    weight_update_session: bool  # POST /begin_weight_update, /end_weight_update
    checker_allow_quant_error: bool
    checker_skip_tensor_list: bool  # also `selector`
    weight_version_route: bool  # GET /weight_version answers the version (else 404, read /model_info)
    compare_drops_snapshot: bool  # per rank, after a compare that passed on that rank
    checksum_per_gpu: bool  # checksum answers carry per_gpu_checksum / per_engine_checksum
    checksum_roles_list: bool  # a checksum rank's parallelism_info is a list of role entries (else one dict)

    @classmethod
    def of(cls, version: str) -> Features:
        v = parse_version(version)
        return cls(
            version=version,
            weight_update_session=v >= SESSIONS_SINCE,
            checker_allow_quant_error=v >= CHECKER_QUANT_ERROR_SINCE,
            checker_skip_tensor_list=v >= CHECKER_SKIP_LIST_SINCE,
            weight_version_route=v < (0, 5, 12),
            compare_drops_snapshot=v >= (0, 5, 21),
            checksum_per_gpu=v >= (0, 5, 13),
            checksum_roles_list=v >= (0, 5, 21),
        )
