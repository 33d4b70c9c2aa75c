"""Engine statistics (what one step did, what the scheduler holds) and their sinks."""
