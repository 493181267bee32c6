"""In the training process, around MaxText: preflight checks, jax.distributed, the CPU token stream."""
