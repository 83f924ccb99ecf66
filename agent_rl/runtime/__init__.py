"""The run's runtime: ranks and sharding, checkpoints, metrics loggers, the host allocator, memory readings."""
