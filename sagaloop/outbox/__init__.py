"""The transactional outbox helper that gives a user's own service exactly-once effects in its
database (``handle_step``). The relay that publishes the outbox to an external broker moved to
``sagaloop.runtime.relay``; ``Relay`` is kept here for one release."""

from sagaloop.outbox.inbox import StepTask, handle_step
from sagaloop.runtime.relay import Relay

__all__ = ["Relay", "StepTask", "handle_step"]
