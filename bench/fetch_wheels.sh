#!/usr/bin/env bash
# Here (a machine with PyPI): downloads into .whl/ the Python 3.12 wheels that the GPU
# machine lacks for `kvscale serve` (structured outputs' xgrammar included), `transformers
# serve` (the D peer) and the demo tokenizers; carry .whl with the device call and
# `source bench/gpu_setup.sh` there.
# Versions are requirements-dev.txt's pins (one source); the two it lacks are pinned here.
# The image's own torch, triton, transformers, numpy, aiohttp, uvloop and prometheus-client
# are used as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
names=(
  fastapi starlette uvicorn httptools pydantic pydantic_core annotated-types
  typing-inspection typing_extensions opentelemetry-api anyio idna
  openai jiter sniffio httpx2 httpcore2 truststore
  mistral_common jsonschema jsonschema-specifications referencing rpds-py
  pydantic-extra-types pycountry
  xgrammar apache-tvm-ffi
)
wheels=(distro==1.9.0 py-spy==0.4.3)
for name in "${names[@]}"; do
  pin=$(grep -i -m1 "^${name}==" requirements-dev.txt) || {
    echo "no pin for $name in requirements-dev.txt" >&2
    exit 1
  }
  wheels+=("$pin")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wheels[@]}"
ls .whl
