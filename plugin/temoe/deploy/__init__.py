"""What must run without JAX (a test imports this package with JAX blocked): the environment
profile, the container entrypoint, the launch renderer, `temoe doctor`'s front end and its build-time
stack check (`stack`, `temoe doctor --image`)."""
