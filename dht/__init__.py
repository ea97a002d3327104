"""Everything that talks to the hivemind DHT: record validators, membership, shard claims, announcements."""
