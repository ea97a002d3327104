"""Wire-layer errors, split the way h11 splits them.

``RemoteProtocolError``: a peer sent something wrong; the message says what and which peer. Callers log
and skip it; it never reaches the training loop. ``LocalProtocolError``: we tried to build or send
something invalid; that is our bug or bad user input, and it is raised loudly.

The subclasses of ``RemoteProtocolError`` name the check that refused the input, so callers and tests can
tell a replay from a forgery without parsing messages. Every one of them is still a
``RemoteProtocolError``: code that only wants "log and skip" catches the root.
"""

from __future__ import annotations

# Re-exported: the root of every wire error, so callers catch them all with one name from this module.
from parallax.errors import ProtocolError as ProtocolError


class RemoteProtocolError(ProtocolError):
    """A peer's bytes were refused. ``peer`` is the claimed sender's fingerprint when known."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        self.peer, self.reason = peer, message
        super().__init__(f"{message} (peer {peer})" if peer else message)


class OversizedMessage(RemoteProtocolError):
    """The input is larger than the cap for its kind; refused before any decoding."""


class MalformedMessage(RemoteProtocolError):
    """The bytes do not parse, or a field has the wrong type, range or length (truncation included)."""


def malformed(error: ProtocolError, peer: str | None) -> MalformedMessage:
    """``error``, met decoding a peer's bytes, as the ``MalformedMessage`` that names ``peer`` once (of ``error``'s own
    class when it is one: a ``NonFiniteTensor`` stays one)."""
    kind = type(error) if isinstance(error, MalformedMessage) else MalformedMessage
    return kind(error.reason if isinstance(error, RemoteProtocolError) else str(error), peer=peer)


class StalledStream(RemoteProtocolError):
    """A peer opened its answer and then sent nothing for longer than the reader waits between two messages: it
    accepted the request and holds the caller (an honest peer answers at once, if only with an empty stream)."""


class SlowStream(RemoteProtocolError):
    """A peer answered, each message within the reader's wait between two, and the whole answer still went on past
    the caller's bound: a trickle that is never held long enough to be a ``StalledStream``, or a link far slower
    than the bound assumes. No evidence (an honest peer on a slow link does it too), but nothing to wait for either."""


class UnsupportedVersion(RemoteProtocolError):
    """The envelope names a protocol version this node does not speak."""


class UnknownKind(RemoteProtocolError):
    """The envelope names a message kind that is not registered, or not the one expected here."""


class WrongRun(RemoteProtocolError):
    """The envelope belongs to another training run."""


class BadSignature(RemoteProtocolError):
    """The signature does not verify under the claimed sender's key and the kind's domain."""


class WrongSigner(RemoteProtocolError):
    """A valid signature, but not by the key this message had to come from (the one the membership names for
    the peer asked)."""


class BadTimestamp(RemoteProtocolError):
    """The envelope's timestamp is outside the accepted window (``stale`` says which side)."""

    def __init__(self, message: str, *, peer: str | None = None, stale: bool) -> None:
        self.stale = stale
        super().__init__(message, peer=peer)


class ReplayedMessage(RemoteProtocolError):
    """The sequence number is not greater than the last one accepted from this sender for this kind."""


class BadTensor(MalformedMessage):
    """A tensor failed its checks: dtype, shape, element count, byte length, finiteness or norm."""


class NonFiniteTensor(BadTensor):
    """A tensor that decodes, in a codec and dtype the reader accepts, to NaN or Inf values (or non-finite scales or
    factors): what no honest encoder sends, since every encoder refuses non-finite input."""


class LocalProtocolError(ProtocolError):
    """We tried to encode, sign or send something invalid."""


class KeyFileError(LocalProtocolError):
    """A key file is missing, malformed, or readable by other users."""
