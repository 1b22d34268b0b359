"""Context-parallel schedules and the kernels they run, all under ``shard_map``."""
