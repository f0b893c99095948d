"""RabbitMQ, the production broker (pika's asynchronous ``SelectConnection``).

Topology: two durable topic exchanges, the public one named after the namespace and
``{namespace}.internal``; per queue ``Q`` a durable queue ``{namespace}.{Q}`` bound with routing
key ``Q`` to the internal exchange and, for an engine queue only, to the public one; dead letters
in ``{namespace}.dead``. So any AMQP client starts a run by publishing JSON to exchange
``sagaloop`` with routing key ``<app>.engine``, and can reach no step queue; RabbitMQ
permissions can fence the internal exchange (docs/operations.md).

Trust: with ``signing_key``, every message this broker publishes carries a signature header
(HMAC-SHA256 of its queue and body, ``signing.py``), and a delivery is ``trusted`` only when its
signature verifies. Consumers refuse internal messages (step, step result, timer) that are not.

One class, :class:`RabbitBroker`, in parts that each state the invariants they keep:

- ``link``: the connection, its I/O thread (the only one that calls pika), the hosts of a
  cluster tried in turn, reconnecting, and declaring the topology on every connection;
- ``publishing``: batches written whole, publisher confirms awaited together, ``mandatory``;
- ``consuming``: deliveries buffered, consumers made on demand, leases and retries;
- ``dead_letters``: dead-lettering a delivery, and reading, resending, purging dead letters;
- ``broker``: the constructor and the wiring of a new connection's channels.
"""

from sagaloop.brokers.rabbitmq.broker import RabbitBroker
from sagaloop.brokers.rabbitmq.consuming import POLL, RabbitDelivery
from sagaloop.brokers.rabbitmq.link import FIRST_BACKOFF, MAX_BACKOFF, refused_access

__all__ = [
    "FIRST_BACKOFF",
    "MAX_BACKOFF",
    "POLL",
    "RabbitBroker",
    "RabbitDelivery",
    "refused_access",
]
