"""Wire formats: identities and signatures, message envelopes, tensor codecs.

Pure: standard library, ``cryptography``, ``msgpack`` and numpy only; no torch, no hivemind, no I/O.
Every byte a node reads from a peer passes through here first; anything refused raises a
``RemoteProtocolError`` subclass (``parallax.protocol.errors``) and nothing else.
"""
