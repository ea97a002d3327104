"""What crosses the network between composers: surrogate gossip, expert snapshots, outer rounds."""
