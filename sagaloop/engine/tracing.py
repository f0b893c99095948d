"""Moved to ``sagaloop.tracing`` (a leaf every layer calls); this name is kept for one release.

The old name is the same module object, so code that patches it patches the one in use."""

import sys

from sagaloop import tracing

sys.modules[__name__] = tracing
