"""Parallax: decentralized training of sparse Mixture-of-Experts models.

Sub-packages (imports point one way: cli -> node -> dht -> protocol):
    parallax.protocol  wire formats: identities, signed envelopes, tensor codecs (pure, no I/O)
    parallax.dht       everything that talks to the hivemind DHT
    parallax.node      the composer: model, data, training loop, surrogates, outer sync
    parallax.cli       the Typer app behind the ``parallax`` command
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__version__ = "0.1.0"


def load(path: str | os.PathLike[str], device: str = "cpu") -> nn.Module:
    """The model of a folder written by ``parallax export``, as a torch module in eval mode."""
    from parallax.node.export.folder import load as load_model

    return load_model(path, device)
