"""Running one engine over several devices (tensor parallelism)."""
