"""What must run without JAX (a test imports this package with JAX blocked): the environment
profile, the container entrypoint, the launch renderer and `temoe doctor`'s front end."""
