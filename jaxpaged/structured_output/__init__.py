"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance
and turned into a per-step token bitmask on the host (``docs/structured_outputs.md``).

Host code only (no JAX): the bitmask travels to the jitted sampler as one more fixed-shape
input (``jaxpaged.sampling.sampler.apply_token_bitmask``).
"""
