"""Exception types: every failure names the thing that failed and, where there is one, the fix."""


class P2PError(RuntimeError):
    """Base class of every error this backend raises on purpose."""


class P2PConfigError(P2PError, ValueError):
    """A bad `engine_kwargs.verl_p2p` key or value, or a rollout server setting p2p cannot work with."""


class UnsupportedLayoutError(P2PError):
    """A rollout layout the trainer-side replica cannot reproduce byte for byte."""


class RemoteMismatchError(P2PError):
    """A target's published weights disagree with what the trainer would write (name, numel, element size)."""


class TransferError(P2PError):
    """A write to a target failed or timed out; the target's bytes are unknown afterwards."""


class RolloutHTTPError(P2PError):
    """A rollout server answered an error, or did not answer in time."""


class MalformedAnswerError(P2PError, ValueError):
    """A rollout server's answer (server info, rank info) lacks the documented shape or holds impossible values."""
