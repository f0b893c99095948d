"""Signatures of the messages sagaloop's own processes publish on a broker outside the database.

The key is shared through the database (``SqlStore.signing_key``): every sagaloop process has
database access, and a publisher that only has the AMQP contract does not. A signature is the
HMAC-SHA256, in hex, of the queue the message is for and its body, so a signed message is
trusted only on its own queue and only byte for byte. Consumers compare in constant time.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "x-sagaloop-signature"
"""The AMQP header that carries the signature."""


def sign(key: bytes, queue: str, body: bytes) -> str:
    mac = hmac.new(key, queue.encode("utf-8", "surrogatepass") + b"\n", hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def verify(key: bytes | None, queue: str, body: bytes, signature: object) -> bool:
    """Whether ``signature`` (a header value: str, bytes or anything) signs ``body`` for
    ``queue`` with ``key``. Without a key nothing verifies."""
    if key is None:
        return False
    if isinstance(signature, bytes):
        signature = signature.decode("ascii", "replace")
    if not isinstance(signature, str):
        return False
    return hmac.compare_digest(sign(key, queue, body), signature)
