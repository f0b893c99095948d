"""The customer refund agent: a Pydantic AI agent run as a durable sagaloop saga.

- ``app``: the saga ``refund-dispute``, its steps and the agent (``SagaAgent``), on
  ``App("refunds")``.
- ``data``: the pydantic models the saga exchanges (no agent imported).
- ``model``: the agent's model: ``$REFUNDS_MODEL``, or an offline ``FunctionModel`` policy.
- ``provider``: local fake services with their own storage (payment provider, ledger, mailbox).

``sagaloop demo`` runs it in real processes and kills one at the worst moment.
"""
