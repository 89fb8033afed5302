"""Errors every openprime package raises. Each says what went wrong and, where there is one, the fix."""

from __future__ import annotations


class OpenPrimeError(Exception):
    """Base class of every error openprime raises on purpose."""


class ConfigError(OpenPrimeError, ValueError):
    """A config value or combination is invalid; raised before anything is started or allocated."""


class PeerFailure(OpenPrimeError):
    """One or more peers were lost, or did not answer before a deadline.

    Raised by every `Transport` operation and by the collectives built on them instead of hanging.
    `peers` holds the ranks (in the transport's group) that failed, so that the caller can rebuild
    the group without them.
    """

    def __init__(self, peers: tuple[int, ...] | list[int] | int, reason: str) -> None:
        self.peers = (peers,) if isinstance(peers, int) else tuple(sorted(set(peers)))
        self.reason = reason
        super().__init__(f"peer(s) {list(self.peers)} failed: {reason}")


class FrameError(OpenPrimeError):
    """A peer sent bytes that are not a valid frame (bad magic, version, size or header)."""

    def __init__(self, peer: int | str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(f"invalid frame from peer {peer}: {reason}")


class ReplicaDivergence(OpenPrimeError):
    """Replicas that must hold bit-identical global state do not (their hashes differ)."""
