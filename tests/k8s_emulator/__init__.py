"""A Kubernetes API server emulator for tests, built on kmock (see README.md here)."""

from tests.k8s_emulator.runner import EmulatorThread
from tests.k8s_emulator.server import ApiServer

__all__ = ["ApiServer", "EmulatorThread"]
