"""The process boundary: the engine core in its own process (``engine_process``), the API
process's handle on it (``async_engine``), the typed messages between them
(``messages``) and their framing on a pipe (``frames``)."""
