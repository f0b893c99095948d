"""The transactional outbox: the relay that publishes it to an external broker."""

from sagaloop.outbox.relay import Relay

__all__ = ["Relay"]
