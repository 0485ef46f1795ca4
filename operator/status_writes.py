"""The status versions this operator wrote that its watch has not shown it yet.

A pass diffs the status it computes against the LLMDeployment as the watch last showed it
and writes nothing when they agree. With two operator replicas, one whose Deployment watch
lags writes an older ready count over the other's newer one; when that Deployment event
then arrives, its LLMDeployment copy may still be the other's write, agree with the newer
count, and so correct nothing, and no later event comes (seen in CI: READY stuck at 2 of
3). So a pass after one of this operator's own status writes diffs against a fresh read
unless the watched copy is that write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvscale.operator.kube import KubeClient
from kvscale.operator.reconcile import LLMDEPLOYMENTS

Key = tuple[str, str]  # (namespace, name)


class StatusWrites:
    """Per LLMDeployment, the resourceVersion of this operator's last status write until a
    pass has seen the object at or past it."""

    def __init__(self) -> None:
        self._unseen: dict[Key, str] = {}

    def wrote(self, namespace: str, name: str, version: str | None) -> None:
        """Records a pass's status write (``version``: the written object's
        resourceVersion; None: nothing was written)."""
        if version is not None:
            self._unseen[(namespace, name)] = version

    async def current(
        self, api: KubeClient, namespace: str, name: str, watched: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        """``watched`` (the watch's copy) if it can be diffed against: no own write is
        pending, or the copy is that write. Else the object read fresh (None if gone)."""
        version = self._unseen.pop((namespace, name), None)
        if version is None or watched["metadata"].get("resourceVersion") == version:
            return watched
        return await api.get(LLMDEPLOYMENTS.path(namespace, name))

    def forget(self, namespace: str, name: str) -> None:
        """The LLMDeployment is gone."""
        self._unseen.pop((namespace, name), None)
