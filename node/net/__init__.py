"""What crosses the network between composers: surrogate gossip, expert snapshots, peer scores, the status server."""
