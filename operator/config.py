"""Operator-wide settings, read once from the environment (the Helm chart sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

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
        )
