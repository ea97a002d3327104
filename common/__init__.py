"""Parallax: decentralized training of sparse Mixture-of-Experts models.

Sub-packages (imports point one way: cli -> node -> dht -> protocol):
    parallax.protocol  wire formats: identities, signed envelopes, tensor codecs (pure, no I/O)
    parallax.dht       everything that talks to the hivemind DHT
    parallax.node      the composer: model, data, training loop, surrogates, outer sync
    parallax.cli       the Typer app behind the ``parallax`` command
"""

__version__ = "0.1.0"
