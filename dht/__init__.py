"""Everything that talks to the hivemind DHT: record validators, membership, shard claims, announcements.

Modules:
    shards      pure: capacity-weighted rendezvous hashing with bounded loads -> owner and heir per expert
    keys        the names of DHT keys (run-namespaced) and expert ids
    adapter     the only module importing hivemind's DHT: start/join, multiaddr checks, timed store/get
    records     the Ed25519 record validator (signed, owner-bound subkeys) and the value codec
    claims      pure: leased claim records and which claims are valid
    membership  the announcer thread (JOINING/ONLINE/LEAVING), heartbeats, deathrattle, the live view
    status      pure: a view -> the peer and ownership rows of ``parallax swarm status``
    testing     local loopback swarms for tests and benchmarks

Concurrency model (the one place it is described):
    hivemind runs each node's DHT in a forked child process (with its p2pd), reached over a pipe.
    In the node's own process exactly one background thread per node, ``Membership``'s announcer,
    makes the periodic DHT calls (heartbeat, claims, reading members and claims), each blocking for
    at most its ``timeout_s``. It publishes an immutable ``SwarmView`` snapshot by replacing a
    reference; the training loop reads ``view()`` and calls ``update(step=...)`` and never waits on
    the network. A failed or late call keeps the previous view (whose expirations keep aging), and
    a bad record from a peer is logged and skipped, never raised into the training loop.
"""
