# syntax=docker/dockerfile:1.7
# The kvscale operator: Kopf running kvscale.operator.handlers. No torch, no GPU.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvscale/kvscale-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/operator-requirements.txt /tmp/requirements.txt
# setuptools/wheel for building /src without isolation (pyproject: setuptools>=68, newer
# than the base's venv has); removed again below, the final image has no build tools.
RUN pip install --no-deps -r /tmp/requirements.txt setuptools==84.2.1 wheel==0.48.0
# Only the operator's code; --no-deps keeps the server's torch stack out of this image.
COPY pyproject.toml setup.py README.md /src/
COPY kvscale /src/kvscale
COPY operator /src/operator
# setup.py maps server/, kernels/ and router/ too: empty stand-ins, their code stays out
# of this image.
RUN mkdir -p /src/server /src/kernels /src/router \
    && touch /src/server/__init__.py /src/kernels/__init__.py /src/router/__init__.py \
    && pip install --no-deps --no-build-isolation /src \
    && pip uninstall -y setuptools wheel

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvscale-operator" \
      org.opencontainers.image.description="kvscale operator (kopf, LLMDeployment controller)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.source="https://github.com/kvscale/kvscale" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin kvscale
# The working directory must not contain an operator/ folder (it would shadow the stdlib).
WORKDIR /tmp
ENV PATH=/opt/venv/bin:$PATH PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["kopf"]
CMD ["run", "-m", "kvscale.operator.handlers", "--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
