"""temoe's MoE core, plain JAX that knows nothing of MaxText: a frozen context (`context`), the block
(`block`: dispatch -> exchange -> experts -> combine), dispatch plans (`dispatch`), expert-parallel
exchange strategies (`exchange/`), expert-MLP kernels (`experts/`), routing's output type
(`routing`) and the non-finite guard (`finite_guard`)."""
