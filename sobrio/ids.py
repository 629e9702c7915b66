"""Request ids: one shape for every layer that names a request (the server, the gateway's middleware)."""

import uuid


def new_id(prefix: str) -> str:
    """`prefix-` and 32 random hex digits (`chatcmpl-...`, `cmpl-...`, `req-...`): never derived from input."""
    return f"{prefix}-{uuid.uuid4().hex}"
