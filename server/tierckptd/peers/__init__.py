"""The peer tier: membership, the peer client, cluster commit, replication and healing."""
