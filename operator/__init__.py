"""The LLMDeployment operator (Kopf).

``spec`` parses the typed spec, ``render`` turns it into manifests (pure functions),
``status`` computes conditions, ``reconcile`` runs one idempotent pass through ``kube``
(a small API client), and ``handlers`` is Kopf's entry point
(``kopf run -m kvscale.operator.handlers``).
"""
