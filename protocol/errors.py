"""Wire-layer errors, split the way h11 splits them.

``RemoteProtocolError``: a peer sent something wrong; the message says what and which peer. Callers log
and skip it; it never reaches the training loop. ``LocalProtocolError``: we tried to build or send
something invalid; that is our bug or bad user input, and it is raised loudly.
"""

from __future__ import annotations

from parallax.errors import ProtocolError


class RemoteProtocolError(ProtocolError):
    """A peer's bytes were refused. ``peer`` is the claimed sender's fingerprint when known."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        self.peer = peer
        super().__init__(f"{message} (peer {peer})" if peer else message)


class LocalProtocolError(ProtocolError):
    """We tried to encode, sign or send something invalid."""


class KeyFileError(LocalProtocolError):
    """A key file is missing, malformed, or readable by other users."""
