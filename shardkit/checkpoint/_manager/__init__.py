"""CheckpointManager with its retention policies, preemption watcher and step store."""
