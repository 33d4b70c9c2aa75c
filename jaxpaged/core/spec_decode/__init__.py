"""Speculative decoding on the host: its config, the n-gram proposer, the adaptive rule and the
scheduler's speculation hooks (the device half is ``jaxpaged.spec_decode``)."""
