"""The LLMDeployment operator (Kopf).

``spec`` parses the typed spec, ``render`` turns it into manifests (pure functions),
``status`` computes conditions, ``reconcile`` runs one idempotent pass through ``kube``
(a small API client), and ``handlers`` is Kopf's entry point
(``kopf run -m kvscale.operator.handlers``).

The autoscaler: ``scaling`` decides (pure, HPA semantics), ``podmetrics`` reads KV-cache
usage and queue depth per pod (Prometheus or the pods' ``/metrics``), ``leader`` holds a
Lease per LLMDeployment, ``autoscaler`` runs the loop, ``telemetry`` is the operator's own
Prometheus metrics.
"""
