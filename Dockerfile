# syntax=docker/dockerfile:1
#
# One image runs every splitserve service: `splitserve gateway|prefill|decode [flags]`.
#
#   GPU (default):  docker build -t splitserve:cuda .
#   CPU:            docker build -t splitserve:cpu --build-arg BASE=python:3.11-slim \
#                                --build-arg TORCH_VARIANT=cpu .
#
# TORCH_VARIANT picks the PyTorch wheel index (https://download.pytorch.org/whl/<variant>):
# `cpu`, or a CUDA build such as `cu128` that the CUDA runtime in BASE can run. TORCH_VERSION
# must exist on that index. The image also carries the tiny model (built once, here) and makes it
# the default (SPLITSERVE_MODEL=tiny), so a container started without --model serves it at once,
# replicas never race to build it, and nothing is fetched (`splitserve up` outside a container
# fetches SmolLM2-135M-Instruct instead).

ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_VARIANT=cu128
ARG TORCH_VERSION=2.13.0

# ---- the Python interpreter (and, for CUDA builds, what Triton compiles its launchers with)
FROM ${BASE} AS python-base
ARG TORCH_VARIANT
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# NOTE: python:*-slim already has python3 (with headers); the CUDA images have none. Triton
# builds a small C launcher at run time, so GPU images need a C compiler and Python headers.
RUN set -eux; \
    pkgs=""; \
    if ! command -v python3 >/dev/null; then pkgs="python3 python3-venv python3-dev"; fi; \
    if [ "${TORCH_VARIANT}" != "cpu" ]; then pkgs="${pkgs} gcc libc6-dev"; fi; \
    if [ -n "${pkgs}" ]; then \
        apt-get update; \
        apt-get install -y --no-install-recommends ${pkgs}; \
        rm -rf /var/lib/apt/lists/*; \
    fi

# ---- build: a virtual environment with torch from its own index, then the project
FROM python-base AS build
ARG TORCH_VARIANT
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}
RUN pip install --upgrade pip \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY . .
# NOTE: the versions the test suite last passed with (constraints.txt), torch aside: it came from
# its own index above, at TORCH_VERSION.
RUN grep -v '^torch==' constraints.txt > /tmp/constraints.txt \
    && PIP_CONSTRAINT=/tmp/constraints.txt pip install . \
    && splitserve --help >/dev/null
# The tiny model (`--model tiny`) at the path `splitserve.launch.default_model.tiny_model_dir()`
# reads (XDG_CACHE_HOME).
ENV XDG_CACHE_HOME=/opt/splitserve/cache
RUN python -c "from splitserve.launch.default_model import ensure_tiny_model; print(ensure_tiny_model())"

# ---- runtime: the venv and the model, run as an unprivileged user
FROM python-base AS runtime
ARG UID=10001
RUN groupadd --gid ${UID} splitserve \
    && useradd --uid ${UID} --gid ${UID} --create-home --home-dir /home/splitserve \
       --shell /usr/sbin/nologin splitserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/splitserve /opt/splitserve
# NOTE: XDG_CACHE_HOME only has to be readable (the model is already there); everything that
# writes a cache goes to /tmp, so the root file system can be mounted read-only.
ENV PATH=/opt/venv/bin:${PATH} \
    XDG_CACHE_HOME=/opt/splitserve/cache \
    HF_HOME=/tmp/huggingface \
    TRITON_HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    SPLITSERVE_HOST=0.0.0.0 \
    SPLITSERVE_MODEL=tiny
WORKDIR /home/splitserve
USER ${UID}:${UID}
# gRPC: gateway 50051, prefill 50061, decode 50071; Prometheus /metrics: 9100, 9101, 9102.
EXPOSE 50051 50061 50071 9100 9101 9102
# gRPC health (grpc.health.v1, service ""): exit 0 only on SERVING. The port comes from
# SPLITSERVE_PORT, as for the service itself. compose.yaml runs the same probe; Kubernetes uses
# its native grpc probes instead.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; \
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
channel = grpc.insecure_channel('127.0.0.1:' + os.environ.get('SPLITSERVE_PORT', '50051')); \
sys.exit(g.HealthStub(channel).Check(h.HealthCheckRequest(service=''), timeout=3).status \
!= h.HealthCheckResponse.SERVING)"]
# SIGTERM drains: health turns NOT_SERVING, in-flight requests finish, then the process exits.
STOPSIGNAL SIGTERM
ENTRYPOINT ["splitserve"]
CMD ["--help"]
