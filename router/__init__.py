"""``kvscale route``: a prefix-aware OpenAI-compatible reverse proxy in front of the
ready replicas of one deployment.

``balance``: pure hashing, ring and replica choice; ``prompt``: a request's leading token
ids (the server's tokenization and chat rendering); ``endpoints``: where the replica
addresses come from (a static list; the interface a Kubernetes watcher plugs into) and
their polled readiness and load; ``metrics``: the router's Prometheus metrics;
``app``: the proxy; ``cli``: the flags and the process.
"""
