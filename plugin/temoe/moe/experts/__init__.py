"""Expert-MLP kernels behind one contract: `xla` (jax.lax.ragged_dot, runs anywhere, the oracle),
`te` (Transformer Engine's grouped GEMM) and `mosaic` (temoe's own Pallas Mosaic GPU grouped GEMMs
for Hopper). The recipe registry (`temoe.recipes`) says which kernel serves which recipe."""
