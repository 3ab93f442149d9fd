"""The memory tier: files under memory.dir, the warm pool, manifests, adoption, incoming copies."""
