"""What an LLMDeployment may ask for, stated once for the CRD and the operator.

The CRD (schema bounds, ``pattern``s and CEL rules, evaluated by the API server) and the
operator's own checks (``spec.py``) must refuse exactly what the server would refuse at
start, or a spec passes admission and its pods crash-loop. The server's limits live in
its ``EngineConfig`` (``server/config.py``) and launcher, which the operator cannot import
(its image has no torch); so the limits are written here once, the operator checks them,
and ``tests/operator/test_admission.py`` checks this table against the CRD and against
the server's real flag parser and ``EngineConfig``, so none of the three can drift.

Regular expressions are written so that they mean the same in the API server's dialect
(RE2, for ``pattern`` and CEL ``matches``) and in Python: ASCII classes only (RE2's ``\\w``
and ``\\s`` are ASCII, Python's are not), and Python matches them with ``fullmatch`` (its
``$`` also matches before a final newline; RE2's does not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---- flags the operator renders from typed fields: extraArgs may not name them -------------
SPECULATIVE_FLAGS = (  # from spec.speculative (issue 18's flag contract of kvscale serve)
    "--speculative-method",
    "--num-speculative-tokens",
    "--speculative-model",
    "--speculative-placement",
    "--ngram-min",
    "--ngram-max",
    "--speculative-disable-by-batch-size",
)
RENDERED_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--device",
    "--dtype",
    "--max-num-seqs",
    "--drain-timeout",
    "--gpu-memory-utilization",
    "--max-model-len",
    "--block-size",
    "--max-num-batched-tokens",
    "--max-queue-len",
    "--tensor-parallel-size",
    "--quantization",
    "--kv-cache-dtype",
    "--enable-prefix-caching",
    *SPECULATIVE_FLAGS,
)
SECRET_FLAGS = ("--api-key",)  # set from a Secret through the environment, never a flag
BOOLEAN_FLAGS = ("--enable-prefix-caching",)  # each also has a --no-... form
MANAGED_FLAGS = (
    *RENDERED_FLAGS,
    *SECRET_FLAGS,
    *(f"--no-{f[2:]}" for f in BOOLEAN_FLAGS),
)


ARG_PATTERN = r"^[^\x00-\x1f\x7f]*$"  # an extraArgs item: no control characters


def smuggled_flag(arg: str) -> str | None:
    """Why ``arg`` may not be an extraArgs item, or None. Refused: ``--flag=value`` (a flag
    and its value are two items, so that the check below sees the flag's whole name) and
    any prefix of a managed flag (``--api-k``: argparse would take a unique prefix for the
    flag unless ``allow_abbrev=False``; refusing prefixes keeps that true whatever the
    parser does). The CRD's CEL rule says the same (``extra_args_rule``)."""
    if arg.startswith("--") and "=" in arg:
        return f"{arg!r}: pass a flag and its value as two items, not --flag=value"
    flag = next((f for f in MANAGED_FLAGS if f.startswith(arg)), None)
    if flag is not None:
        return (
            f"{arg!r} could set {flag}, which the operator sets from the typed fields "
            "(flags cannot be abbreviated either); use the typed field"
        )
    return None


def extra_args_rule(flags: tuple[str, ...] = MANAGED_FLAGS) -> str:
    """The CRD's CEL rule on ``spec.engine.extraArgs`` (cheap: no regex)."""
    names = ", ".join(f"'{f}'" for f in flags)
    return (
        "self.all(a, !(a.startsWith('--') && a.contains('=')) && "
        f"![{names}].exists(f, f.startsWith(a)))"
    )


# ---- environment variables the operator sets on the server container -----------------------
MANAGED_ENV = (
    "HOME",
    "KVSCALE_CACHE",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRITON_CACHE_DIR",
    "KVSCALE_API_KEY",
)

# ---- model sources and URLs --------------------------------------------------------------
_HF_NAME = r"[A-Za-z0-9](?:\.?[A-Za-z0-9_-])*"  # no "..", no leading or trailing "."
_PATH = r"(?:/[A-Za-z0-9_][A-Za-z0-9_.-]*)*/?"  # segments never start with "." (no "..")
_S3_KEY = r"(?:/[A-Za-z0-9_][A-Za-z0-9_.=+-]*)*/?"
SOURCE_PATTERN = (
    rf"^(?:hf://{_HF_NAME}(?:/{_HF_NAME})?"
    rf"|pvc://[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?{_PATH}"
    rf"|s3://[a-z0-9][a-z0-9.-]{{1,61}}[a-z0-9]{_S3_KEY}"
    r"|builtin://demo)$"
)
REVISION_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_./-]*$"  # a branch, tag or commit
URL_PATTERN = (
    r"^https?://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
    r"(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~%!$&'()*+,;=:@/-]*)?$"
)
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"  # the API server's own
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"  # what the API server accepts for env


def matches(pattern: str, value: str) -> bool:
    """``value`` matches the whole of an anchored ``pattern``, as RE2 would."""
    return re.fullmatch(pattern, value) is not None


# ---- numeric bounds and allowed values, checked against the server -------------------------
@dataclass(frozen=True)
class Bound:
    """The values a spec field may take, and the server flag it becomes."""

    flag: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[object, ...] | None = None


BOUNDS: dict[str, Bound] = {
    "spec.model.maxModelLen": Bound("--max-model-len", 16, 1 << 20),
    "spec.engine.maxNumSeqs": Bound("--max-num-seqs", 1, 65536),
    "spec.engine.maxNumBatchedTokens": Bound("--max-num-batched-tokens", 1, 1 << 20),
    "spec.engine.blockSize": Bound("--block-size", choices=(8, 16, 32, 64, 128)),
    "spec.engine.maxQueueLen": Bound("--max-queue-len", 1, 1_000_000),
    "spec.engine.gpuMemoryUtilization": Bound("--gpu-memory-utilization", 0.05, 1.0),
    "spec.engine.tensorParallelSize": Bound("--tensor-parallel-size", 1, 8, (1, 2, 4, 8)),
    "spec.lifecycle.drainTimeoutSeconds": Bound("--drain-timeout", 0, 3600),
}
MAX_REPLICAS = 1000  # replicas, autoscaling.minReplicas / maxReplicas
