"""Model families (Flax NNX) and checkpoint loading."""
