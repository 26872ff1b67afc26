# syntax=docker/dockerfile:1
#
# One image for every specdec component: the entrypoint is the `specdec` CLI
# and the sub-command (gateway | scorer | proposer) picks the service.
#
#   docker build --build-arg VARIANT=cpu  -t REGISTRY/specdec:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t REGISTRY/specdec:0.1.0-cuda .
#
# The Helm chart runs "<tag>-cpu" for everything, and "<tag>-cuda" for the
# scorer and the draft proposer when gpu.enabled.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}

# cpu | cuda
ARG VARIANT=cpu
# Must match the torch pin in pyproject.toml.
ARG TORCH_VERSION=2.13.0
# The PyTorch wheel index of the CUDA build. Its wheels bundle the CUDA
# runtime libraries, so GPU nodes need only the NVIDIA driver and device plugin.
ARG TORCH_CUDA=cu128

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/specdec \
    PATH=/opt/specdec/bin:$PATH

# Triton compiles a small launcher with the system C compiler the first time
# a CUDA kernel runs; the CPU variant runs the torch references instead.
RUN case "$VARIANT" in \
      cpu) ;; \
      cuda) apt-get update \
            && apt-get install -y --no-install-recommends gcc libc6-dev \
            && rm -rf /var/lib/apt/lists/* ;; \
      *) echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 1 ;; \
    esac

# torch first, from the index of the variant; `pip install .` then keeps it
# (2.13.0+cpu / +cu128 satisfy the project's torch==2.13.0).
RUN python -m venv "$VIRTUAL_ENV" \
    && case "$VARIANT" in \
         cpu) index=https://download.pytorch.org/whl/cpu ;; \
         cuda) index="https://download.pytorch.org/whl/${TORCH_CUDA}" ;; \
       esac \
    && pip install --index-url "$index" "torch==${TORCH_VERSION}"

COPY . /src
RUN pip install /src

RUN useradd --uid 10001 --user-group --create-home --home-dir /home/specdec specdec
USER 10001
ENV HOME=/home/specdec \
    HF_HOME=/home/specdec/.cache/huggingface \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    TRITON_CACHE_DIR=/tmp/triton-cache
WORKDIR /home/specdec

LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Speculative decoding as gRPC microservices (gateway, scorer, proposers)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.specdec.variant="${VARIANT}"

# gateway, scorer, proposer gRPC ports; Prometheus metrics
EXPOSE 50050 50051 50052 9090
ENTRYPOINT ["specdec"]
CMD ["--help"]
