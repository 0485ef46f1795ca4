"""The LLMDeployment operator (kopf)."""
