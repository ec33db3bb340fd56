"""The training-loop layer: model + optimizer in one call, and a run's checkpoints over time."""
