"""The console's Starlette app: pages rendered from :mod:`sagaloop.ui.views` with Jinja2, kept
live by htmx (a region polls and is sent again only when what it shows moved), and the
operator's actions as POSTs through :class:`~sagaloop.Client`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from sagaloop.brokers.dead_letters import DeadLetter
from sagaloop.client import Client
from sagaloop.engine import answers
from sagaloop.engine import state as s
from sagaloop.errors import RunNotFoundError, SagaloopError
from sagaloop.sagas.app import App
from sagaloop.sagas.approvals import KEY_PREFIX
from sagaloop.ui import ops, runs, views
from sagaloop.ui.security import Guard, csrf_ok, new_csrf
from sagaloop.ui.story import event_of, file_name, history_document, pretty

HERE = Path(__file__).parent
HTMX = "htmx.min.js"
"""htmx 2.0.11, the exact ``dist/htmx.min.js`` of the npm package ``htmx.org`` (0BSD: see
``static/htmx.LICENSE``); its SHA-256 is pinned by tests/ui/test_ui_app.py."""
REFRESH = 2.0
"""How often (seconds) a live region asks whether what it shows moved, by default."""
MAX_FORM = 256 * 1024
HTMX_CONFIG = {
    "includeIndicatorStyles": False,  # no inline style: the CSP allows none
    "allowEval": False,
    "historyCacheSize": 0,  # keep runs' data out of the browser's localStorage
    "responseHandling": [
        {"code": "204", "swap": False},  # a live region that did not move
        {"code": "[2345]..", "swap": True},  # errors are pages that say what to do
        {"code": "...", "swap": False},
    ],
}
DONE = {
    "approved": "Approved: the run goes on with the arguments shown.",
    "denied": "Denied: the run receives the reason.",
    "cancelled": "Cancellation requested: the run stops at its next suspension point and "
    "compensates its completed steps.",
    "retried": "Retry requested: the run resumes.",
    "forked": "Forked: this new run keeps what the commands before the position did and goes "
    "on from there with the code as it is now.",
    "event": "Event sent.",
    "resent": "Resent: the message is back on the queue it came from.",
}
"""What the page says after an action (chosen by key: no text travels in the address)."""


Endpoint = Callable[[Request], Response]


class Refused(Exception):
    """An action refused: answered with this status and text on the page."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def create_app(
    client: Client,
    app: App | None = None,
    token: str | None = None,
    *,
    refresh: float = REFRESH,
    dead_letters: Callable[[int], list[DeadLetter]] | None = None,
    broker: ops.BrokerOpener | None = None,
) -> Starlette:
    """The console of the runs ``client`` reads (``app``: the App whose sagas name the saga
    filter's choices; ``token``: required of every request, see :mod:`sagaloop.ui.security`;
    ``refresh``: how often, in seconds, open pages ask whether what they show moved;
    ``dead_letters``: reads up to N dead letters of the broker in use, oldest first, as
    ``sagaloop dead-letters list`` does - None: read through ``broker``; ``broker``: opens
    the broker in use for one read or action, for the Workers page's queue depths and the
    Resend of dead letters - None: the database broker over the client's store). Serve it
    with any ASGI server (``sagaloop ui`` uses uvicorn); bind it to 127.0.0.1 unless it has a
    token (:func:`~sagaloop.ui.security.check_bind`)."""
    if client.app_name:  # another app's runs are not found (apps may share a database)
        client = client.scoped()
    csrf = new_csrf()
    if dead_letters is None:
        dead_letters = ops.dead_letter_reader(client, broker)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["pretty"] = pretty
    env.filters["when"] = views.when
    env.filters["q"] = lambda value: urlencode({"id": value})
    app_name = app.name if app is not None else client.app_name
    sagas = sorted(app.sagas) if app is not None else []

    def page(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        done = request.query_params.get("done")
        if "approvals_open" not in context:  # the header's count: a whole page's
            context["approvals_open"] = "" if template[0] == "_" else runs.pending_approvals(client)
        html = env.get_template(template).render(
            csrf=csrf,
            app_name=app_name,
            path=request.url.path,
            refresh=f"{max(round(refresh * 1000), 100)}ms",
            htmx_config=json.dumps(HTMX_CONFIG),
            flash=DONE.get(done or ""),
            **context,
        )
        return HTMLResponse(html, status_code=status)

    def live(request: Request, stamp: str, template: str, /, **context: Any) -> Response:
        """A live region: 204 (nothing to swap) while it shows ``stamp`` already."""
        if request.query_params.get("v") == stamp:
            return Response(status_code=204)
        return page(request, template, **context)

    def failed(request: Request, e: Exception) -> HTMLResponse:
        if isinstance(e, Refused):
            status, message = e.status, e.message
        elif isinstance(e, RunNotFoundError):
            status, message = 404, str(e)
        else:
            status, message = 409, str(e)
        return page(request, "error.html", status, message=message)

    def listing(
        template: str,
        live_template: str,
        context_of: Callable[[Request], dict[str, Any]],
        stamp_of: Callable[[dict[str, Any]], str],
    ) -> tuple[Endpoint, Endpoint]:
        """The page ``template`` of ``context_of(request)``, and its live region
        ``live_template`` (204 while it shows ``stamp_of(context)`` already)."""

        def full(request: Request) -> Response:
            try:
                return page(request, template, **context_of(request))
            except SagaloopError as e:
                return failed(request, e)

        def region(request: Request) -> Response:
            try:
                context = context_of(request)
            except SagaloopError as e:
                return failed(request, e)
            return live(request, stamp_of(context), live_template, **context)

        return full, region

    # --- runs --------------------------------------------------------------------------------

    counts = runs.Counts()

    def runs_context(request: Request) -> dict[str, Any]:
        filters = runs.filters_of(request.query_params)
        return {
            "view": runs.runs_page(client, filters, counts),
            "filters": filters,
            "query": filters.query(after=filters.after, before=filters.before),
            "statuses": s.ALL_STATUSES,
            "ages": list(runs.AGES),
            "fields": runs.FIELDS,
            "sagas": sagas,
            "actions": runs.ACTIONS,
        }

    def runs_page(request: Request) -> Response:
        try:
            return page(request, "runs.html", **runs_context(request))
        except SagaloopError as e:
            return failed(request, e)

    def runs_live(request: Request) -> Response:
        """204 (htmx) or 304 (``If-None-Match``) while no run moved: one indexed read."""
        try:
            stamp = runs.stamp(client)
            etag = f'"{stamp}"'
            if request.query_params.get("v") == stamp:
                return Response(status_code=204, headers={"etag": etag})
            if request.headers.get("if-none-match") == etag:
                return Response(status_code=304, headers={"etag": etag})
            counted = runs.pending_approvals(client)
            context = runs_context(request)
            response = page(
                request, "_runs_live.html", live=True, approvals_open=counted, **context
            )
        except SagaloopError as e:
            return failed(request, e)
        response.headers["etag"] = etag  # read before the page: a later move shows next poll
        return response

    async def runs_bulk(request: Request) -> Response:
        """Cancel or retry the ticked runs, once confirmed; the result says which were done
        and which refused, and why."""
        try:
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_FORM:
                    raise Refused(413, f"the form is over {MAX_FORM // 1024} KiB")
            try:
                bulk = runs.bulk_form(body, csrf)
            except runs.BulkRefused as e:
                raise Refused(e.status, e.message) from None
            if dict(parse_qsl(body.decode("utf-8", errors="replace"))).get("confirmed") != "1":
                return page(request, "runs_confirm.html", bulk=bulk, fields=runs.bulk_fields(bulk))
            result = await run_in_threadpool(runs.do_bulk, client, bulk)
        except (SagaloopError, Refused) as e:
            return failed(request, e)
        return page(request, "runs_done.html", result=result)

    # --- one run -----------------------------------------------------------------------------

    def run_id_of(request: Request) -> str:
        run_id = request.query_params.get("id")
        if not run_id:
            raise Refused(400, "name the run: /run?id=RUN_ID")
        return run_id

    def of_run(
        template: str,
        live_template: str,
        view_of: Callable[[Client, str, dict[str, str]], Any],
        **extra: Any,
    ) -> tuple[Endpoint, Endpoint]:
        """The page ``template`` of the view ``view_of(client, run_id, query)`` of the run
        ``?id=``, and its live region ``live_template`` (204 while the run's version is
        ``?v=``)."""

        def full(request: Request) -> Response:
            try:
                view = view_of(client, run_id_of(request), dict(request.query_params))
            except (SagaloopError, Refused) as e:
                return failed(request, e)
            return page(request, template, view=view, **extra)

        def region(request: Request) -> Response:
            try:
                run_id = run_id_of(request)
                seen = request.query_params.get("v")
                if seen == views.run_version(client, client.get(run_id)):
                    return Response(status_code=204)
                view = view_of(client, run_id, dict(request.query_params))
            except (SagaloopError, Refused) as e:
                return failed(request, e)
            return page(request, live_template, view=view, **extra)

        return full, region

    run_page, run_live = of_run(
        "run.html", "_run_live.html", views.run_view, approval_prefix=KEY_PREFIX
    )
    transcript, transcript_live = of_run(
        "transcript.html", "_transcript_live.html", lambda c, r, q: views.transcript_view(c, r)
    )

    def history_json(request: Request) -> Response:
        """The run's whole history as ``sagaloop export`` writes it, to download."""
        try:
            run_id = run_id_of(request)
            text = json.dumps(history_document(client, run_id), indent=2, ensure_ascii=False)
        except (SagaloopError, Refused) as e:
            return failed(request, e)
        disposition = f'attachment; filename="{file_name(run_id)}"'
        return Response(
            text, media_type="application/json", headers={"content-disposition": disposition}
        )

    def value_page(request: Request) -> Response:
        """The whole data of one event of a run (``?id=RUN&seq=N``): what a row cut."""
        try:
            run_id = run_id_of(request)
            seq = request.query_params.get("seq", "")
            event = event_of(client, run_id, int(seq)) if seq.isdigit() else None
            if event is None:
                raise Refused(404, f"run {run_id!r} has no event {seq!r}")
        except (SagaloopError, Refused) as e:
            return failed(request, e)
        return page(request, "value.html", run_id=run_id, event=event)

    # --- approvals and dead letters ------------------------------------------------------------

    def approvals_context(request: Request) -> dict[str, Any]:
        """A page of the open approvals (``?after=CURSOR``: the page after that one), each
        with the answer that won it, while the engine has not recorded it."""
        after = request.query_params.get("after") or None
        rows = client.store.open_approvals(
            app=client.app_name,
            after=None if after is None else answers.read_cursor(after),
            limit=views.APPROVALS_PAGE,
        )
        cards = [c for c in map(views.approval_card, rows) if c is not None]
        stamp = views.version(
            [(r.run_id, r.call_id, r.status, r.request, r.answer_id) for r in rows]
        )
        more = cards[-1].cursor if len(rows) == views.APPROVALS_PAGE and cards else None
        page_query = urlencode({"after": after}) if after else ""
        next_query = urlencode({"after": more}) if more else ""
        return {"pending": cards, "stamp": stamp, "page": page_query, "next": next_query}

    approvals, approvals_live = listing(
        "approvals.html", "_approvals_live.html", approvals_context, lambda c: c["stamp"]
    )

    def dead_letters_page(request: Request) -> Response:
        try:
            letters = views.dead_letters(client, dead_letters)
        except SagaloopError as e:
            return failed(request, e)
        return page(request, "dead_letters.html", letters=letters)

    def workers_context(request: Request) -> dict[str, Any]:
        # no faster than processes refresh their rows (each look may open a broker connection)
        poll = f"{round(max(refresh, ops.POLL) * 1000)}ms"
        return {"view": ops.workers(client, broker), "poll": poll}

    workers, workers_live = listing(
        "workers.html", "_workers_live.html", workers_context, lambda c: c["view"].version
    )

    # --- actions -------------------------------------------------------------------------------

    async def form(request: Request, *, of_run: bool = True) -> dict[str, str]:
        """The POSTed form, once its CSRF token is checked (``of_run``: it must name a run)."""
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM:
                raise Refused(413, f"the form is over {MAX_FORM // 1024} KiB")
        fields = dict(parse_qsl(body.decode("utf-8", errors="replace"), keep_blank_values=True))
        if not csrf_ok(csrf, fields.get("csrf")):
            raise Refused(
                403, "this form is not one of the console's current pages: reload the page"
            )
        if of_run and not fields.get("run_id"):
            raise Refused(400, "the form names no run")
        return fields

    def action(
        handler: Callable[[dict[str, str]], str | tuple[str, str] | None],
        confirm: str | Callable[[dict[str, str]], str] | None = None,
    ) -> Callable[[Request], Any]:
        """A POST endpoint: check the form, ask for confirmation (``confirm``: the question)
        unless the form says ``confirmed``, call ``handler`` (it returns the ``done`` key, or
        the key and the run to show instead), then show the run (or the approvals page, for an
        answer given there)."""

        async def endpoint(request: Request) -> Response:
            try:
                fields = await form(request)
                if confirm is not None and fields.get("confirmed") != "1":
                    return page(
                        request,
                        "confirm.html",
                        question=confirm if isinstance(confirm, str) else confirm(fields),
                        fields=fields,
                        action=request.url.path,
                    )
                done = await run_in_threadpool(handler, fields)
            except (SagaloopError, Refused) as e:
                return failed(request, e)
            shown = fields["run_id"]
            if isinstance(done, tuple):
                done, shown = done
            where = "/approvals?" if fields.get("next") == "approvals" else "/run?"
            query = {} if where == "/approvals?" else {"id": shown}
            if done:
                query["done"] = done
            return RedirectResponse(where + urlencode(query), status_code=303)

        return endpoint

    def do_cancel(f: dict[str, str]) -> str:
        reason = f.get("reason") or "cancelled in the console"
        client.cancel(f["run_id"], reason, now=f.get("now") == "1")
        return "cancelled"

    def do_retry(f: dict[str, str]) -> str:
        client.retry(f["run_id"])
        return "retried"

    def do_fork(f: dict[str, str]) -> tuple[str, str]:
        at = f.get("at", "")
        if not at.isdigit():
            raise Refused(400, "name the position to fork at: the # of a step")
        return "forked", client.fork(f["run_id"], int(at))

    def do_event(f: dict[str, str]) -> str:
        name = f.get("name", "").strip()
        if not name:
            raise Refused(400, "name the event")
        data = _json_field(f.get("data", ""), "the event's data")
        client.send_event(f["run_id"], name, data, event_id=f.get("event_id") or None)
        return "event"

    def answer(f: dict[str, str]) -> tuple[str, str, str, Any]:
        """(run id, call id, who, the arguments asked about) of an answer to an approval, once
        the hash the page showed is checked against the approval the run waits for."""
        run_id, call_id = f["run_id"], f.get("call_id", "")
        pending = {p.call_id: p for p in client.approvals(run_id)}
        request = pending.get(call_id)
        if request is None:
            raise Refused(409, f"run {run_id!r} waits for no approval {call_id!r} any more")
        if f.get("args_hash") != request.args_hash:
            raise Refused(
                409,
                f"the arguments of approval {call_id!r} are not those the page showed (hash "
                f"{request.args_hash[:12]}): reload the page and check them again",
            )
        return run_id, call_id, (f.get("by") or "").strip() or "sagaloop ui", request.args

    def do_approve(f: dict[str, str]) -> str:
        """Approve; with the field ``args`` (the card's "edit arguments" form), these
        arguments in place of those asked about, as ``sagaloop approve --args`` does (the
        run's schema, when it published one, refuses an edit that does not fit)."""
        run_id, call_id, by, asked = answer(f)
        edited = None
        if "args" in f:
            if not f["args"].strip():
                raise Refused(400, "the edit of the arguments is empty: write the JSON to approve")
            edited = _json_field(f["args"], "the edit of the arguments")
            if edited == asked:
                edited = None  # not an edit: approve what was asked
            elif edited is None:
                raise Refused(
                    400, "null cannot replace the arguments: approve them unedited, or deny"
                )
        client.approve(run_id, call_id, args=edited, by=by)
        return "approved"

    def do_deny(f: dict[str, str]) -> str:
        run_id, call_id, by, _ = answer(f)
        reason = (f.get("reason") or "").strip()
        if not reason:
            raise Refused(400, "a denial needs a reason: say why")
        client.deny(run_id, call_id, reason=reason, by=by)
        return "denied"

    async def resend_letter(request: Request) -> Response:
        """Resend one dead letter (``id``), once confirmed, then show the dead letters."""
        try:
            fields = await form(request, of_run=False)
            letter_id = fields.get("id", "")
            if not letter_id:
                raise Refused(400, "the form names no dead letter")
            if fields.get("confirmed") != "1":
                question = (
                    f"Resend dead letter {letter_id} to the queue it came from? It is "
                    "published unchanged (a consumer that processed it already skips it) and "
                    "leaves the dead letters."
                )
                return page(
                    request,
                    "confirm.html",
                    question=question,
                    fields=fields,
                    action=request.url.path,
                    back="/dead-letters",
                )
            await run_in_threadpool(ops.resend, client, broker, letter_id)
        except (SagaloopError, Refused) as e:
            return failed(request, e)
        return RedirectResponse("/dead-letters?done=resent", status_code=303)

    routes = [
        Route("/", lambda request: RedirectResponse("/runs", status_code=303)),
        Route("/runs", runs_page),
        Route("/runs/live", runs_live),
        Route("/runs/bulk", runs_bulk, methods=["POST"]),
        Route("/run", run_page),
        Route("/run/live", run_live),
        Route("/run/history.json", history_json),
        Route("/run/value", value_page),
        Route("/run/transcript", transcript),
        Route("/run/transcript/live", transcript_live),
        Route("/approvals", approvals),
        Route("/approvals/live", approvals_live),
        Route("/dead-letters", dead_letters_page),
        Route("/dead-letters/resend", resend_letter, methods=["POST"]),
        Route("/workers", workers),
        Route("/workers/live", workers_live),
        Route(
            "/run/cancel",
            action(
                do_cancel,
                "Cancel this run? It stops at its next suspension point and compensates "
                "its completed steps.",
            ),
            methods=["POST"],
        ),
        Route(
            "/run/retry",
            action(do_retry, "Retry this run? It resumes where it stopped."),
            methods=["POST"],
        ),
        Route("/run/event", action(do_event), methods=["POST"]),
        Route(
            "/run/fork",
            action(
                do_fork,
                lambda f: (
                    f"Fork this run at position #{f.get('at')} (step {f.get('step')})? A "
                    "new run keeps what the commands before it did (their recorded results, "
                    "nothing run again) and runs this step and what follows with the code as it is "
                    "now. This run is left as it is."
                ),
            ),
            methods=["POST"],
        ),
        Route("/approve", action(do_approve), methods=["POST"]),
        Route("/deny", action(do_deny), methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(Guard, token=token)])


def _json_field(text: str, what: str) -> Any:
    """A form field's JSON (empty: null), parsed as the engine reads messages: no NaN."""
    if not text.strip():
        return None

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON (send null or a string)")

    try:
        return json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError) as e:
        raise Refused(400, f"{what} is not valid JSON: {e}") from None
