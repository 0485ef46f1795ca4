#!/usr/bin/env bash
# Here (a machine with PyPI): downloads into .whl/ the Python 3.12 wheels that the GPU
# machine lacks for `kvscale serve`, `transformers serve` (the D peer) and the demo
# tokenizers; carry .whl with the device call and `source bench/gpu_setup.sh` there.
# Versions follow requirements-dev.txt; the image's own torch, triton, transformers,
# numpy, aiohttp, uvloop and prometheus-client are used as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0
  pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0 opentelemetry-api==1.45.2 anyio==4.16.0 idna==3.20
  openai==3.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx2==2.16.2
  httpcore2==2.16.2 truststore==0.10.5
  mistral_common==1.13.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 pydantic-extra-types==2.11.1 pycountry==26.2.16
  py-spy==0.4.3
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wheels[@]}"
ls .whl
