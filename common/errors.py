"""The exception root of Parallax, with one class per layer.

Bad user input raises ``ValueError`` with the fix in the message; these classes are for failures of
the system itself, so callers can catch one layer's failures without catching programming errors.
"""


class ParallaxError(Exception):
    """Root of every exception Parallax raises on purpose."""


class ProtocolError(ParallaxError):
    """A wire-format failure (see ``parallax.protocol.errors`` for the remote/local split)."""


class DHTError(ParallaxError):
    """The DHT could not be started, reached or trusted."""


class NodeError(ParallaxError):
    """The composer or worker could not proceed (model, data, checkpoint, device)."""
