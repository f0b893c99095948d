"""The customer refund agent: an AI-agent loop as a durable sagaloop saga.

- ``app``: the saga ``refund-dispute`` and its steps, on ``App("refunds")``.
- ``model``: the ``Model`` protocol that picks the next action, and a scripted default.
- ``provider``: local fake services with their own storage (payment provider, ledger, mailbox).

``sagaloop demo`` runs it in real processes and kills one at the worst moment.
"""
