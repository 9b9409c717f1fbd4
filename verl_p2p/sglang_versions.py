"""The SGLang releases that changed what p2p may ask of a rollout server, and the one parser of their versions.

Every cut-off compares the release numbers only (major, minor, patch): a pre-release, post-release or local
build of 0.5.21 (`0.5.21rc0`, `0.5.21.post1`, `0.5.21+cu128`) has what 0.5.21 has. packaging's ordering would put
`0.5.21rc0` before `0.5.21`, and a release candidate of the first release with sessions would then be taken for
a server without them.
"""

from __future__ import annotations

import re

Release = tuple[int, int, int]

SESSIONS_SINCE: Release = (0, 5, 21)  # /begin_weight_update and /end_weight_update
CHECKER_SKIP_LIST_SINCE: Release = (0, 5, 21)  # weights_checker's skip_tensor_list (and selector)
CHECKER_QUANT_ERROR_SINCE: Release = (0, 5, 15)  # weights_checker compare's allow_quant_error

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_release(text: object) -> Release | None:
    """`"0.5.21"`, `"0.5.21rc0"`, `"0.5.23.post1"`, `"0.5.12+cu128"` -> (0, 5, 21) ...; None for anything else
    (a missing or garbled `version` in /server_info: the caller decides what unknown means)."""
    if text is None:
        return None
    match = _RELEASE.match(str(text))
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def release_text(release: Release) -> str:
    """(0, 5, 21) -> "0.5.21" (for messages)."""
    return ".".join(map(str, release))


def at_least(version: object, since: Release) -> bool | None:
    """Whether the server's release is `since` or later; None when its version cannot be read."""
    release = parse_release(version)
    return None if release is None else release >= since


def has_sessions(version: object) -> bool | None:
    """Whether a server of this release has weight-update sessions; None when its version cannot be read."""
    return at_least(version, SESSIONS_SINCE)
