"""Wire formats: identities and signatures, message envelopes, tensor codecs. Pure: no torch, no hivemind, no I/O."""
