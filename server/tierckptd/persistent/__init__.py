"""The persistent tier: the fsspec store, its format, the drain, retention, durability."""
