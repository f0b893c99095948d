"""The client: start, signal, cancel, retry and read runs, without saga code running and
without the runtime. :class:`Client` writes to the store through the engine's ports and reads
runs back as a :class:`~sagaloop.client.timeline.Timeline` (one status model for ``sagaloop
status``, ``status --json`` and the console); ``serving`` tells whether a live process serves a
run's waiting steps, and ``admission`` holds the start backlog limit ``Client.start``
enforces. ``Client`` (``client``) is carried out with ``checks`` (what it refuses before
writing, by the engine's rules), ``fork`` (forking a run) and ``approvals`` (answering an
approval)."""

from sagaloop.client.client import Client as Client
from sagaloop.client.polling import NotPublishedError as NotPublishedError
from sagaloop.client.queries import QueryDef as QueryDef
from sagaloop.client.queries import RunView as RunView
from sagaloop.client.queries import query as query
