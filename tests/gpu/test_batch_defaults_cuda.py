"""The batch limits picked from the GPU's size, as the server's API process picks them
(GPU machine only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvscale.server.config import DEFAULT_BATCH, LARGE_GPU_BATCH, LARGE_GPU_BYTES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# In a fresh process, as `kvscale serve`'s API process: the GPU memory in use (MiB) before
# and after the settings resolve; a CUDA context would hold a few hundred MiB.
PROBE = """
import json, subprocess
def used():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", "0"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])
before = used()
from kvscale.server.config import EngineConfig
cfg = EngineConfig(device="cuda")
print(json.dumps({"seqs": cfg.max_num_seqs, "graphs": cfg.cuda_graph_max_batch,
                  "before": before, "after": used()}))
"""


def test_the_gpus_size_picks_the_batch_and_no_context_is_made() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    total = torch.cuda.get_device_properties(0).total_memory
    want = LARGE_GPU_BATCH if total >= LARGE_GPU_BYTES else DEFAULT_BATCH
    assert (res["seqs"], res["graphs"]) == want, (res, total)
    assert res["after"] - res["before"] < 64, res
