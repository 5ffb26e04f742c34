"""State-dict helpers: model and optimizer state keyed by the unwrapped model's FQNs."""
