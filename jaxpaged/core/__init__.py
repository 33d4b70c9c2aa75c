"""The step contract, free of JAX: requests, the scheduler and KV cache manager, SchedulerOutput
and the runner-output types, the input/output processors and detokenizer, host pooling, and
the host half of speculative decoding (docs/architecture.md)."""
