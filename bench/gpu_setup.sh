#!/usr/bin/env bash
# Source on the GPU machine (device tool) before a run: installs the carried wheels (.whl,
# made here by bench/fetch_wheels.sh: the server's, transformers-serve's and the demo
# tokenizers' deps missing there, and py-spy) and kvscale itself (editable, no deps: the
# machine's torch/triton/transformers are used).
export PYTHONSAFEPATH=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . >/dev/null || return 1
python3 - <<'PY'
import platform, torch, triton, transformers
print(f"python {platform.python_version()} torch {torch.__version__} triton {triton.__version__} "
      f"transformers {transformers.__version__} gpu {torch.cuda.get_device_name()}")
PY
