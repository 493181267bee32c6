"""temoe's MoE block: router -> dispatch -> experts -> combine, one module a stage."""
