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
    from parallax.node.export.folder import ExportedModel

__version__ = "0.1.0"


def load(path: str | os.PathLike[str], device: str = "cpu") -> ExportedModel:
    """A folder written by ``parallax export``, checked: ``.model`` (the torch module, every expert real, in eval
    mode), ``.cfg`` (its settings), ``.tokenizer``, ``.config`` (config.json) and ``.generate(prompt)``.

    Raises:
        parallax.node.export.folder.ExportError: not a model folder, or a corrupt one (the message says what to do).
    """
    from parallax.node.export.folder import read_model

    return read_model(path, device)
