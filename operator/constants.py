"""Names shared by the CRD, the rendered objects and the handlers."""

from __future__ import annotations

GROUP = "serving.kvscale.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SHORT_NAME = "llmd"
CRD_NAME = f"{PLURAL}.{GROUP}"

# Labels on everything the operator creates.
OWNER_LABEL = f"{GROUP}/llmdeployment"  # the owning LLMDeployment's name (also the selector)
# The router's objects carry this instead of OWNER_LABEL (the server pods' selector, the
# autoscaler's pod list and the child indexes must not see them): the owner's name.
ROUTER_LABEL = f"{GROUP}/router"
ROUTER_APP = "kvscale-router"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGER = "kvscale-operator"
NAME_LABEL = "app.kubernetes.io/name"
SERVER_APP = "kvscale-server"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"

# Annotations.
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"  # hash of what the operator rendered (no replicas)

# The server container.
SERVER_PORT = 8000
MODEL_ROOT = "/models"
# The draft sidecar (spec.speculative placement sidecar) serves the target on a Unix socket
# in an emptyDir both containers mount.
DRAFT_SOCKET_DIR = "/var/run/kvscale-draft"
DRAFT_SOCKET = f"{DRAFT_SOCKET_DIR}/draft.sock"
# The router container (spec.router): kvscale route.
ROUTER_PORT = 8080
TOKENIZER_ROOT = "/tokenizer"  # the model's tokenizer files, for prefix routing
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set on nodes by NVIDIA GPU feature discovery
RUN_AS_USER = 1000

# Condition types (status.conditions[].type).
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
SCALING_ACTIVE = "ScalingActive"  # owned by the autoscaler; this operator only initialises it
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED, SCALING_ACTIVE)
