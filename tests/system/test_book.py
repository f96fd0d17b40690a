"""The book (make book): the chapters as a static site, read in real Chromium from disk.

The site is built from notebooks/ (or D2L_CHAPTERS=DIR, a re-executed copy) by
book/build.py. The test opens index.html with no server, follows the table of contents
to every chapter, saves a screenshot of each under test-artifacts/, and checks what a
reader sees there: the chapter's number in its headings, numbered and captioned figures
(plots and diagrams, in one sequence) that load,
math drawn, every finished %launch as its summary (never a dashboard caught
'starting'), no raw d2l markup, no error, and nothing fetched from anywhere.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, need
from nbtools import load_book
from test_browser import ARTIFACTS, CHROMIUM, FLAGS

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

pytest.importorskip('latex2mathml')
CHAPTERS = Path(os.environ.get('D2L_CHAPTERS', ROOT / 'notebooks'))
SUMMARY = re.compile(r'^job (finished|failed|stopped|timeout) after .*\n  process ', re.M)
LIVE = re.compile(r'^%launch .*: (starting|running), |'                 # the status line
                  r'^  (scheduler|server \d+|worker \d+) +\S+ +(starting|running)\b', re.M)


@pytest.fixture(scope='module')
def site(tmp_path_factory):
    """The built site's index.html (book/build.py, as make book runs it)."""
    out = tmp_path_factory.mktemp('book')
    subprocess.run([sys.executable, str(ROOT / 'book' / 'build.py'), '--chapters', str(CHAPTERS),
                    '--out', str(out)], check=True, timeout=300)
    return out / 'index.html'


@pytest.fixture(scope='module')
def page(site):
    """A Chromium page that records every request, console error and page error."""
    need(os.access(CHROMIUM, os.X_OK), f'Chromium ({CHROMIUM}, Debian package chromium)')
    need(sync_playwright is not None, 'Playwright for Python')
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={'width': 1200, 'height': 900})
            page.requests, page.errors = [], []
            page.on('request', lambda r: page.requests.append(r.url))
            page.on('pageerror', lambda e: page.errors.append(str(e)))
            page.on('console', lambda m: m.type == 'error' and page.errors.append(m.text))
            yield page
        finally:
            browser.close()


@pytest.mark.slow
def test_every_chapter_reads_right(page, site):
    book = load_book()
    ORDER = [name for name, _ in book.numbered()]
    page.goto(site.as_uri())
    hrefs = 'els => els.map(e => e.getAttribute("href"))'
    assert page.eval_on_selector_all('main ol a', hrefs) == [f'{n}.html' for n in book.CHAPTERS]
    assert page.eval_on_selector_all('main ul a', hrefs) == [f'{n}.html' for n in book.APPENDICES]
    ARTIFACTS.mkdir(exist_ok=True)
    for i, (name, number) in enumerate(book.numbered(), 1):
        page.goto(site.as_uri())
        page.click(f'main a[href="{name}.html"]')
        page.wait_for_load_state('load')
        assert page.url.endswith(f'/{name}.html')
        page.screenshot(path=str(ARTIFACTS / f'book-{number}-{name}.png'), full_page=True)
        check_chapter(page, number)
        nxt = page.query_selector('nav.d2l-top a.d2l-next')
        assert (nxt.get_attribute('href') if nxt else None) == \
            (f'{ORDER[i]}.html' if i < len(ORDER) else None)
    assert page.errors == []
    fetched = [u for u in page.requests if not u.startswith(('file:', 'data:'))]
    assert fetched == []                                   # nothing from the network


def check_chapter(page, number):
    """What a reader of chapter `number` sees: numbers, figures, math, finished jobs."""
    h1 = page.inner_text('h1')
    assert h1.startswith(f'{number}. ')
    for h2 in page.eval_on_selector_all('h2', 'els => els.map(e => e.innerText)'):
        assert re.match(fr'{number}\.\d+\. ', h2), h2
    text = page.inner_text('main')
    for raw in (':label:', ':numref:', 'Traceback (most recent call last)',
                'Error displaying widget', 'No renderer could be found'):
        assert raw not in text
    prose = page.eval_on_selector_all(        # markdown cells without their code spans
        '.jp-MarkdownOutput', 'els => els.map(e => { const c = e.cloneNode(true); '
        'c.querySelectorAll("code, pre").forEach(x => x.remove()); return c.innerText; })')
    assert not any('$' in p for p in prose)                  # math was drawn, as MathML
    figures = page.eval_on_selector_all(      # plots and diagrams, in the order of the page
        '.jp-OutputArea img, .d2l-diagram img', 'els => els.map(e => [e.naturalWidth, '
        'e.parentElement.nextElementSibling ? e.parentElement.nextElementSibling.innerText : ""])')
    for k, (width, caption) in enumerate(figures, 1):
        assert width > 100 and caption.startswith(f'Figure {number}.{k}'), (k, width, caption)
        assert len(caption.split(maxsplit=2)) == 3, f'Figure {number}.{k} has no caption'
    for cell in page.query_selector_all('.jp-CodeCell'):
        check_launch(cell)


def check_launch(cell):
    """A cell that ran %launch shows one finished summary per launch, and no live state."""
    code = cell.query_selector('.jp-InputArea-editor')
    launches = len(re.findall(r'^(?:try:\n[ \t\xa0]+)?%launch ', code.inner_text() if code else '',
                              re.M))      # (as tests/unit/test_reader.py counts them)
    outputs = cell.query_selector('.jp-OutputArea')
    shown = outputs.inner_text() if outputs else ''
    assert len(SUMMARY.findall(shown)) == launches, shown[:2000]
    assert not LIVE.search(shown), shown[:2000]
