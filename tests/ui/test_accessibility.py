"""The console's pages meet basic accessibility, checked on every page a run of each kind
shows: the page's language and title, a name for every form control (a label around it or
for it, or ``aria-label``), text (or a label) on every button and link, a text alternative
for every image and chart, no positive ``tabindex`` (the keyboard order is the page's order:
every action is a native link, button or form control), and text colours with a contrast of
at least 4.5:1 (WCAG AA) on their backgrounds, read from the console's stylesheet."""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext
from sagaloop.testing import Harness
from sagaloop.ui import create_app

HERE = "http://127.0.0.1:8765"
CSS = Path(__file__).resolve().parents[2] / "sagaloop" / "ui" / "static" / "console.css"
app = App("a11y-shop")


@app.step
def book(ctx: StepContext, city: str) -> dict[str, str]:
    return {"booking": f"BK-{city}"}


@book.compensation
def unbook(ctx: StepContext, city: str, result: dict[str, str]) -> None:
    pass


@app.step(retry=RetryPolicy(max_attempts=1))
def charge(ctx: StepContext, cents: int) -> str:
    raise ApplicationError(f"card declined for {cents}")


@app.saga(name="leg")
async def leg(ctx: SagaContext, city: str) -> dict[str, str]:
    return await ctx.call(book, city)


@app.saga(name="trip")
async def trip(ctx: SagaContext, city: str) -> str:
    await ctx.call(book, city)
    await ctx.call(leg, city, run_id=f"leg-{city}")
    decision = await ctx.approval("refund", {"cents": 1250}, call_id="8")
    if decision.approved:
        await ctx.call(charge, 1250)
    return "done"


@pytest.fixture
def console(tmp_path: Path) -> Iterator[tuple[Harness, TestClient]]:
    env = Harness(app, url=f"sqlite:///{tmp_path / 'a11y.db'}")
    env.start("trip", "Oslo", run_id="waiting")
    env.start("trip", "Rome", run_id="failed")
    env.run_until_idle()
    env.client.approve("failed", "8", by="ann")
    env.run_until_idle()
    yield env, TestClient(create_app(env.client, app), base_url=HERE)
    env.close()


class Page(HTMLParser):
    """What the checks need of a page: its controls, labels, buttons, links, images."""

    CONTROLS = ("input", "select", "textarea")

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.problems: list[str] = []
        self.lang = ""
        self.title = ""
        self.stack: list[tuple[str, dict[str, str | None]]] = []
        self.labelled_ids: set[str] = set()
        self.controls: list[tuple[dict[str, str | None], bool]] = []
        self.named: list[tuple[str, dict[str, str | None], list[str]]] = []  # a, button, svg

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "html":
            self.lang = a.get("lang") or ""
        if tag == "label" and a.get("for"):
            self.labelled_ids.add(str(a["for"]))
        if (a.get("tabindex") or "0").lstrip("-").isdigit() and int(a.get("tabindex") or 0) > 0:
            self.problems.append(f"<{tag}> has tabindex {a['tabindex']}: it breaks the page order")
        if tag == "img" and a.get("alt") is None:
            self.problems.append(f"<img src={a.get('src')!r}> has no alt text")
        if tag in self.CONTROLS and a.get("type") not in ("hidden", "submit"):
            inside_label = any(t == "label" for t, _ in self.stack)
            self.controls.append((a, inside_label))
        for _, entry, texts in self.named:  # text inside an open link, button or chart
            del entry, texts
        if tag in ("a", "button", "svg", "title"):
            self.named.append((tag, a, []))
        if tag not in ("input", "img", "br", "meta", "link", "hr", "rect", "line", "path"):
            self.stack.append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            open_tag, _ = self.stack.pop()
            if open_tag == tag:
                break
        if tag in ("a", "button", "svg"):
            for i in range(len(self.named) - 1, -1, -1):
                name, a, texts = self.named[i]
                if name != tag:
                    continue
                del self.named[i]
                text = " ".join(texts).strip()
                hidden = a.get("aria-hidden") == "true"
                if not (text or a.get("aria-label") or a.get("title") or hidden):
                    self.problems.append(f"<{tag} {a}> has no text or label")
                if tag == "svg" and not hidden and a.get("role") != "img":
                    self.problems.append("an <svg> chart without role=img")
                break
        if tag == "title":
            for i in range(len(self.named) - 1, -1, -1):
                if self.named[i][0] == "title":
                    title_text = " ".join(self.named.pop(i)[2]).strip()
                    if not any(t == "svg" for t, _ in self.stack):
                        self.title = title_text
                    else:  # an svg's title names it
                        for name, _, texts in self.named:
                            if name == "svg":
                                texts.append(title_text)
                    break

    def handle_data(self, data: str) -> None:
        for _, _, texts in self.named:
            texts.append(data)

    def close(self) -> None:
        super().close()
        for a, inside_label in self.controls:
            named = inside_label or a.get("aria-label") or a.get("aria-labelledby")
            if not named and not (a.get("id") and a["id"] in self.labelled_ids):
                self.problems.append(f"form control {a} has no label")


def problems_of(html: str) -> list[str]:
    page = Page()
    page.feed(html)
    page.close()
    found = list(page.problems)
    if not page.lang:
        found.append("<html> names no language")
    if not page.title:
        found.append("the page has no <title>")
    return found


PAGES = [
    "/runs",
    "/runs?status=waiting",
    "/run?id=waiting",
    "/run?id=failed",
    "/run?id=leg-Oslo",
    "/run/transcript?id=waiting",
    "/approvals",
    "/dead-letters",
    "/workers",
]


@pytest.mark.parametrize("path", PAGES)
def test_every_page_names_its_controls_links_and_charts(
    console: tuple[Harness, TestClient], path: str
) -> None:
    _, browser = console
    response = browser.get(path)
    assert response.status_code == 200, response.text[:300]
    assert problems_of(response.text) == []


def test_confirmation_pages_name_their_controls(console: tuple[Harness, TestClient]) -> None:
    _, browser = console
    page = browser.get("/run?id=waiting").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf
    asked = browser.post("/run/cancel", data={"csrf": csrf.group(1), "run_id": "waiting"})
    assert "Cancel this run?" in asked.text
    assert problems_of(asked.text) == []


def test_a_page_without_labels_is_found() -> None:
    """The check itself: a control, a button and a chart without names are each reported."""
    html = (
        '<html lang="en"><head><title>x</title></head><body>'
        '<input name="q"><button></button><svg><rect/></svg><img src="a.png">'
        '<label>Name <input name="ok"></label></body></html>'
    )
    found = problems_of(html)
    assert len(found) == 5, found  # the chart lacks both a name and role=img
    assert any("form control" in p for p in found)


# --- contrast ------------------------------------------------------------------------------


def luminance(hex_colour: str) -> float:
    h = hex_colour.lstrip("#")
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    channels = [int(h[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def rules() -> list[tuple[str, dict[str, str]]]:
    css = re.sub(r"/\*.*?\*/", "", CSS.read_text(), flags=re.S)
    found = []
    for selector, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css):
        decls = {}
        for decl in body.split(";"):
            if ":" in decl:
                name, value = decl.split(":", 1)
                decls[name.strip()] = value.strip()
        found.append((" ".join(selector.split()), decls))
    return found


def test_text_colours_have_a_contrast_of_at_least_4_5_on_their_background() -> None:
    found = rules()
    root = next(d for s, d in found if s == ":root")
    variables = {k: v for k, v in root.items() if k.startswith("--")}

    def colour(value: str | None) -> str | None:
        if value is None:
            return None
        value = re.sub(r"var\((--[\w-]+)\)", lambda m: variables.get(m.group(1), ""), value)
        match = re.search(r"#[0-9a-fA-F]{3,6}\b", value)
        return match.group(0) if match else None

    page_backgrounds = [colour(variables["--bg"]) or "#fff", colour(variables["--card"]) or "#fff"]
    backgrounds = {
        part.strip(): bg
        for s, d in found
        if (bg := colour(d.get("background") or d.get("background-color"))) is not None
        for part in s.split(",")
    }

    def behind(selector: str) -> list[str]:
        """The background a selector's text is on: its own, else its nearest ancestor's
        (``header.top .brand`` is on ``header.top``'s), else the page's and a card's."""
        for one in selector.split(","):
            parts = one.split()
            for n in range(len(parts), 0, -1):
                if (bg := backgrounds.get(" ".join(parts[:n]))) is not None:
                    return [bg]
        return page_backgrounds

    low = []
    for selector, decls in found:
        fg = colour(decls.get("color"))
        if fg is None or ":hover" in selector:
            continue
        for bg in behind(selector):
            assert bg is not None
            if contrast(fg, bg) < 4.5:
                low.append(f"{selector}: {fg} on {bg} is {contrast(fg, bg):.2f}:1")
    assert low == []
