"""tierckptd: the per-node tierckpt daemon (memory tier, and later peers and S3 drain)."""

__version__ = "0.1.0"
