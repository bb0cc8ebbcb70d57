"""From a name to loaded weights: the registry, offline model packages, hub downloads, pairing checks, loading."""
