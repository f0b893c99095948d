"""The transactional outbox: the relay that publishes it to an external broker, and the helper
that gives a user's own service exactly-once effects in its database."""

from sagaloop.outbox.inbox import StepTask, handle_step
from sagaloop.outbox.relay import Relay

__all__ = ["Relay", "StepTask", "handle_step"]
