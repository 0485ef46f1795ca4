"""Operator-wide settings, read once from the environment (the Helm chart sets them)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_SERVER_IMAGE = "ghcr.io/kvscale/kvscale-server:0.1.0"
DEFAULT_S3_DOWNLOADER_IMAGE = "amazon/aws-cli:2.17.0"


@dataclass(frozen=True)
class OperatorConfig:
    """What every LLMDeployment shares unless its spec says otherwise."""

    server_image: str = DEFAULT_SERVER_IMAGE
    s3_downloader_image: str = DEFAULT_S3_DOWNLOADER_IMAGE
    cluster_domain: str = "cluster.local"
    retry_delay_seconds: float = 30.0  # when a Secret is missing, look again this often
    prometheus_url: str | None = None  # the autoscaler's default when the spec names none
    autoscale_interval_seconds: float = 15.0  # the autoscaler's default evaluation period
    metrics_port: int = 0  # the operator's own /metrics; 0: not served
    identity: str = field(default_factory=lambda: default_identity({}))  # Lease holder name

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        return cls(
            server_image=env.get("KVSCALE_SERVER_IMAGE") or DEFAULT_SERVER_IMAGE,
            s3_downloader_image=env.get("KVSCALE_S3_DOWNLOADER_IMAGE")
            or DEFAULT_S3_DOWNLOADER_IMAGE,
            cluster_domain=env.get("KVSCALE_CLUSTER_DOMAIN") or "cluster.local",
            retry_delay_seconds=float(env.get("KVSCALE_RETRY_DELAY_SECONDS") or 30),
            prometheus_url=env.get("KVSCALE_PROMETHEUS_URL") or None,
            autoscale_interval_seconds=float(env.get("KVSCALE_AUTOSCALE_INTERVAL_SECONDS") or 15),
            metrics_port=int(env.get("KVSCALE_METRICS_PORT") or 0),
            identity=default_identity(env),
        )


def default_identity(env: Mapping[str, str]) -> str:
    """Who holds autoscaler Leases: ``$KVSCALE_OPERATOR_ID``, the pod name (``$POD_NAME``,
    set by the chart), else ``hostname-pid``."""
    return (
        env.get("KVSCALE_OPERATOR_ID")
        or env.get("POD_NAME")
        or f"{socket.gethostname()}-{os.getpid()}"
    )
