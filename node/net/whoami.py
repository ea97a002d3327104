"""Which identity a libp2p peer id belongs to, when two signed heartbeats claim the same one.

A heartbeat is signed by its node's Ed25519 identity and names the libp2p peer id the node is reachable at,
but nothing in the heartbeat proves that the node controls that peer id: a squatter can name another node's
peer id in its own heartbeat, and a node that sees two identities claim one peer id can trust neither (the
victim's outer rounds become unverifiable). The proof is a question to the peer id itself: libp2p
authenticates whoever answers at it, and the answer is a signature by the answering node's identity over a
fresh nonce and that peer id (``IdentityServicer.rpc_whoami``). ``IdentityProver`` asks, in the background,
about every peer id claimed twice, and remembers the key that proved it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from parallax.node.net.network import ServedOnLoop
from parallax.protocol.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify
from parallax.protocol.schema import MSGPACK_ERRORS

logger = logging.getLogger(__name__)

WHOAMI_DOMAIN = b"parallax/whoami/v1"
_NONCE_BYTES = 32
_MAX_PROVEN = 4096


def whoami_payload(nonce: bytes, peer_id: str) -> bytes:
    return nonce + peer_id.encode()


class IdentityServicer(ServicerBase):
    """Answers "who are you?" at this node's peer id: [public key, signature over nonce + peer id]. Do not rename
    (protocol id)."""

    def __init__(self, identity: Identity, peer_id: str) -> None:
        self._identity, self._peer_id = identity, peer_id

    async def rpc_whoami(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertInfo:
        try:
            nonce = bytes.fromhex(request.uid) if len(request.uid) == 2 * _NONCE_BYTES else b""
        except ValueError:
            nonce = b""
        if len(nonce) != _NONCE_BYTES:
            return runtime_pb2.ExpertInfo(serialized_info=b"")
        signature = self._identity.sign(WHOAMI_DOMAIN, whoami_payload(nonce, self._peer_id))
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb([self._identity.public_key, signature]))


def read_answer(data: bytes, nonce: bytes, peer_id: str) -> bytes | None:
    """The public key that signed this answer for ``nonce`` at ``peer_id``, or None for anything else."""
    try:
        obj = msgpack.unpackb(data, raw=False, max_bin_len=128, max_array_len=2, max_str_len=0, max_map_len=0)
    except MSGPACK_ERRORS:
        return None
    if not (isinstance(obj, list) and len(obj) == 2 and all(isinstance(x, bytes) for x in obj)):
        return None
    public_key, signature = obj
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return None
    return public_key if verify(public_key, signature, WHOAMI_DOMAIN, whoami_payload(nonce, peer_id)) else None


class IdentityProver(ServedOnLoop):
    """Serves this node's answer and asks other peer ids theirs (on the node's network loop).

    Args:
        p2p, loop: this node's P2P replica and network loop.
        run_id: namespaces the handler.
        identity, peer_id: this node's identity key and libp2p peer id.
        timeout_s: one question.
    """

    def __init__(self, p2p: P2P, loop: asyncio.AbstractEventLoop, run_id: str, identity: Identity, peer_id: str,
                 *, timeout_s: float = 10.0) -> None:
        super().__init__(p2p, loop, f"parallax.{run_id}.whoami", IdentityServicer(identity, peer_id))
        self.timeout_s = timeout_s
        self._proven: dict[str, bytes] = {}
        self._asking: set[str] = set()
        self._lock = threading.Lock()

    def proven(self, peer_id: str, claimants: list[bytes]) -> bytes | None:
        """The claimant key that proved ``peer_id``, if one has; otherwise ask it in the background (never blocks)
        and return None for now."""
        with self._lock:
            key = self._proven.get(peer_id)
            if key is not None and key in claimants:
                return key
            if peer_id in self._asking:
                return None
            self._asking.add(peer_id)
        asyncio.run_coroutine_threadsafe(self._ask(peer_id), self.loop)
        return None

    async def _ask(self, peer_id: str) -> None:
        nonce = os.urandom(_NONCE_BYTES)
        try:
            stub = IdentityServicer.get_stub(self.p2p, PeerID.from_base58(peer_id), namespace=self.namespace)
            answer = await asyncio.wait_for(stub.rpc_whoami(runtime_pb2.ExpertRequest(uid=nonce.hex())),
                                            self.timeout_s)
            key = read_answer(answer.serialized_info, nonce, peer_id)
        except Exception as e:  # unreachable, or not a Parallax peer: no proof this time
            logger.info("peer %s did not say which identity it is: %r", peer_id, e)
            key = None
        with self._lock:
            self._asking.discard(peer_id)
            if key is not None:
                self._proven[peer_id] = key
                while len(self._proven) > _MAX_PROVEN:
                    del self._proven[next(iter(self._proven))]
