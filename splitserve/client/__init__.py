"""The client: a small Python client of the public gRPC API (`api.py`), used by `splitserve
generate` and the tests; and `bench/`, the load generator of `splitserve bench serve`, which
drives that API or any OpenAI-compatible HTTP server.
"""

from splitserve.client.api import BearerKey, Completion, collect, connect, stream

__all__ = ["BearerKey", "Completion", "collect", "connect", "stream"]
