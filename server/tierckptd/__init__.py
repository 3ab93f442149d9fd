"""tierckptd: the per-node tierckpt daemon: the memory tier, replication to peers, and
the drain to a persistent (S3-compatible) tier; docs/design.md's layout section maps the
packages."""

__version__ = "0.1.0"
