"""Speculative decoding: proposals verified in one target step (``docs/speculative_decoding.md``)."""
