"""The GPU worker role: the model, the continuous-batching engine, and token publishing."""
