"""The graph archive: the in-memory graph model, the binary format, manifests and stores."""
