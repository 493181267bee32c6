# temoe on an NGC-style JAX MaxText image: MaxText, JAX, Transformer Engine come from the base.
ARG BASE_IMAGE=ghcr.io/nvidia/jax:maxtext-2026-09-10
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="temoe" \
      org.opencontainers.image.description="Transformer Engine MoE for MaxText" \
      org.opencontainers.image.licenses="Apache-2.0"
WORKDIR /opt/temoe
COPY pyproject.toml README.md ./
COPY plugin ./plugin
COPY configs ./configs
RUN pip install --no-cache-dir --no-deps . && python -c "import temoe"
ENV XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
ENTRYPOINT ["temoe"]
CMD ["train", "/opt/temoe/configs/deepseek3-smoke.yml", "hardware=gpu", "base_output_directory=/tmp/runs"]
