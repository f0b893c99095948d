"""Whether a run would take an event, checked by a client before it sends one: the events its
saga declares (``@app.saga(events=...)``) and the model of the wait open for it. Nothing here
runs saga code: models are imported from the ``module:qualname`` that the run recorded."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from sagaloop.engine.state import RunState
from sagaloop.errors import ValidationError
from sagaloop.sagas.approvals import call_id_of
from sagaloop.sagas.convert import Converter


def check_event(
    state: RunState, name: str, data: Any, declared: Mapping[str, Any] | None = None
) -> None:
    """Refuse (ValidationError, saying that nothing was sent) an event that run ``state``
    would refuse: a name its saga does not declare, if it declares any, or data that does not
    fit the model of the wait open for it or, before that wait begins, the declared model.
    ``declared``: the saga's own declaration (``SagaDef.events``), when the client has the
    App; else the one the run recorded as it started. A model this process cannot import is
    left to the engine, which records a misfit as rejected. Approval answers have their own
    rules (``answers``): not checked here."""
    if call_id_of(name) is not None:
        return
    run_id = state.run_id
    accepts = dict(declared) if declared else dict(state.declared or {})
    if accepts and name not in accepts:
        names = ", ".join(repr(n) for n in sorted(accepts))
        raise ValidationError(
            f"run {run_id!r} (saga {state.saga!r}) does not accept event {name!r}, so nothing "
            f"was sent: it accepts {names}"
        )
    waits = sorted(state.waits.values(), key=lambda w: w.pos)
    wait = next((w for w in waits if name in w.names and not w.resolved), None)
    model: Any = wait.models.get(name) if wait is not None else None
    what = "waits for"
    if model is None:  # before the wait begins (or its model was not recorded): the declared
        model, what = accepts.get(name), "accepts"
    if isinstance(model, str):
        model = importable(model)
    if model is None:
        return
    try:
        Converter(model).from_json(data, what=f"event {name!r}")
    except ValidationError as e:
        raise ValidationError(
            f"the event does not fit what run {run_id!r} {what}, so nothing was sent: {e}"
        ) from None


def importable(path: str) -> Any:
    """The object at ``module:qualname``, or None if this process cannot import it."""
    module_name, _, qualname = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except Exception:
        return None
    return target
