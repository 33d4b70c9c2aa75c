"""The engine core: requests, KV page management, scheduling and the step loop."""
