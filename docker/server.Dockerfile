# syntax=docker/dockerfile:1.7
# The kvscale GPU server: `kvscale serve` on CUDA. torch's Linux wheels carry the CUDA
# runtime; the node's NVIDIA driver comes in through the NVIDIA container toolkit.
# The same image runs on CPU (`--device cpu`, e.g. the e2e tests on kind).
# Build from the repository root:
#   docker build -f docker/server.Dockerfile -t ghcr.io/kvscale/kvscale-server:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, pinned to the GPU machines' version (its own triton comes with it). A CPU
# build for tests: --build-arg TORCH_VERSION=2.13.0 with an index or find-links that serves
# the +cpu wheel (e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu).
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url=$TORCH_INDEX_URL} torch==${TORCH_VERSION}
# Everything else at the versions CI tests (requirements-dev.txt as constraints).
COPY requirements-dev.txt /tmp/requirements-dev.txt
RUN grep -vE '^(torch|triton)==' /tmp/requirements-dev.txt > /tmp/constraints.txt
COPY pyproject.toml setup.py README.md /src/
COPY kvscale /src/kvscale
COPY server /src/server
COPY kernels /src/kernels
COPY operator /src/operator
COPY router /src/router
RUN pip install -c /tmp/constraints.txt "/src[demo,serve,route]"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvscale-server" \
      org.opencontainers.image.description="kvscale inference server (kvscale serve)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.source="https://github.com/kvscale/kvscale" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
# A C compiler: Triton builds its GPU launchers at first use, and kvscale its draft
# sidecar protocol module (server/native_build.py; without one, the Python path runs).
RUN command -v gcc >/dev/null || (apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*)
RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin kvscale
WORKDIR /tmp
# The pod's root filesystem is read-only: caches live under /tmp (an emptyDir there).
ENV PATH=/opt/venv/bin:$PATH PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HOME=/tmp \
    KVSCALE_CACHE=/tmp/kvscale HF_HOME=/tmp/hf TRITON_CACHE_DIR=/tmp/triton
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvscale"]
CMD ["serve", "--model", "demo", "--host", "0.0.0.0", "--port", "8000"]
