"""A tool-calling loop written with the raw ``openai`` client, made durable: the model request
and each tool are steps, the tools offered with ``sagaloop.agents.tools.StepTools``, the
transcript stored once with ``sagaloop.agents.tools.Conversation``.

- ``app``: the saga ``support`` (the ``while`` loop), the model step ``chat`` and the tools, on
  ``App("shop-support")``.
- ``shop``: the shop's own books (orders, refunds, mails) in a SQLite file, outside sagaloop.
"""
