"""Single-device building blocks of the K3 text backbone (one concept per file)."""
