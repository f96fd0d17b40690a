"""%launch in real JupyterLab, in real Chromium: the dashboard fills up, gives way to the
job's final form (summary and figure), and the stop button stops.

JupyterLab runs on 127.0.0.1 with no token, in its own session, with its own root,
config, runtime and settings directories; Chromium is the Debian package driven by
Playwright (no browser download). Screenshots go to test-artifacts/; with
``--docs-screenshot`` the live dashboard's is also saved as docs/dashboard.png, the
README's picture, so that it is always real output of this test:

    CI=true .venv/bin/python -m pytest tests/system/test_browser.py -k stop --docs-screenshot
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from d2ldist.launch.processes import free_port
from support import ROOT, kill_tagged, need, new_tag, tagged_pids, wait_no_survivors
from nbtools import JOB_SCRIPT, notebook

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout, sync_playwright
except ImportError:
    sync_playwright = None

CHROMIUM = '/usr/bin/chromium'
FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync']
ARTIFACTS = ROOT / 'test-artifacts'
DOCS_SCREENSHOT = ROOT / 'docs' / 'dashboard.png'   # the README's picture (--docs-screenshot)
NUM_PROCS = 5                               # %launch -n 2 -s 2: scheduler, 2 servers, 2 workers


@pytest.fixture(scope='module')
def lab(tmp_path_factory):
    """A JupyterLab server of our own; yields (url, root dir); stopped and killed afterwards."""
    need(os.access(CHROMIUM, os.X_OK), f'Chromium ({CHROMIUM}, Debian package chromium)')
    base = tmp_path_factory.mktemp('lab')
    root = base / 'root'
    root.mkdir()
    for plugin, values in (('apputils-extension/notification',      # no news, no pop-ups
                            {'fetchNews': 'false', 'checkForUpdates': False}),
                           ('notebook-extension/tracker', {'autoStartDefaultKernel': True})):
        path = base / 'settings' / '@jupyterlab' / f'{plugin}.jupyterlab-settings'
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    tag = new_tag()                         # the server and its kernels carry it
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base / 'config'),
               JUPYTER_RUNTIME_DIR=str(base / 'runtime'),
               JUPYTERLAB_SETTINGS_DIR=str(base / 'settings'),
               JUPYTERLAB_WORKSPACES_DIR=str(base / 'workspaces'),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')])),
               D2L_TEST_TAG=tag)
    port = free_port()
    log = open(base / 'lab.log', 'w')
    server = subprocess.Popen(         # under the guard: gone even if pytest is killed
        [sys.executable, '-m', 'd2ldist.launch.guard', '--', sys.executable, '-m', 'jupyterlab', '--no-browser', '--ServerApp.ip=127.0.0.1',
         f'--ServerApp.port={port}', '--ServerApp.port_retries=0',
         '--IdentityProvider.token=', '--ServerApp.password=',
         f'--ServerApp.root_dir={root}', '--LabApp.expose_app_in_browser=True',
         '--LabApp.extension_manager=readonly', *(['--allow-root'] if os.geteuid() == 0 else [])],
        env=env, cwd=root, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    url = f'http://127.0.0.1:{port}'
    try:
        _wait_for_server(url, server, base / 'lab.log')
        yield url, root
    finally:
        _stop(server)
        kill_tagged(tag)                    # kernels it might have left behind
        log.close()


def _wait_for_server(url, server, log, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f'JupyterLab exited: {log.read_text()[-2000:]}')
        try:
            with urllib.request.urlopen(f'{url}/api/status', timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f'JupyterLab did not answer within {timeout} s: {log.read_text()[-2000:]}')


def _stop(server):
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope='module')
def browser(lab):
    need(sync_playwright is not None, 'Playwright for Python')
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, request):
    """A fresh page; the whole page is saved as a screenshot afterwards, for failures."""
    context = browser.new_context(viewport={'width': 1440, 'height': 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    try:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f'{request.node.name}-page.png'))
    finally:
        context.close()


def open_and_run(page, lab, name, launch_line):
    """Write a notebook (load, %%writefile, %launch), open it in JupyterLab, run all cells."""
    url, root = lab
    nb = notebook('%load_ext d2ldist', '%%writefile progress_job.py\n' + JOB_SCRIPT, launch_line)
    nbformat.write(nb, root / name)
    page.goto(f'{url}/lab/workspaces/{Path(name).stem}/tree/{name}')   # a workspace each
    wait_for_kernel(url, name)
    deadline = time.monotonic() + 60
    while True:         # Run > Run All Cells; again if the page had no kernel yet
        page.click('.jp-Cell .jp-InputPrompt')              # the notebook has the focus
        page.click('.lm-MenuBar-itemLabel:text-is("Run")')
        page.click('.lm-Menu-itemLabel:text-is("Run All Cells")')
        try:
            page.wait_for_function(STARTED, timeout=10_000)
            break
        except PlaywrightTimeout:
            if time.monotonic() > deadline:
                pytest.fail(f'Run All Cells did not start {name} within 60 s')
    try:
        return page.wait_for_selector('.d2l-dashboard')
    except PlaywrightTimeout:
        pytest.fail(f'no dashboard within 60 s; the notebook shows:\n'
                    f'{page.inner_text(".jp-Notebook")[-3000:]}')


def wait_for_kernel(url, name, timeout=120):
    """Wait until the server runs the notebook's kernel and it is idle.

    The page's kernel indicator reads idle before the kernel exists (its first state), and
    Run All on a page without a kernel runs nothing; a busy machine starts a kernel slowly."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f'{url}/api/sessions', timeout=10) as r:
            if any(s['path'] == name and s['kernel']['execution_state'] == 'idle'
                   for s in json.load(r)):
                return
        time.sleep(0.3)
    pytest.fail(f'the kernel of {name} was not idle within {timeout} s')


# the first cell's prompt shows [*] or [1] once the kernel took it
STARTED = "/\\[[0-9*]+\\]/.test(document.querySelector('.jp-Cell .jp-InputPrompt').innerText)"


def screenshot(element, name):
    ARTIFACTS.mkdir(exist_ok=True)
    element.screenshot(path=str(ARTIFACTS / name))


def docs_picture(page, dashboard, redraws=2):
    """The README's picture (docs/dashboard.png): the live dashboard of a running job once
    its figure has been drawn ``redraws`` more times, so that its curves have some length."""
    page.wait_for_selector('.d2l-dashboard img')
    for _ in range(redraws):
        drawn = page.eval_on_selector('.d2l-dashboard img', 'img => img.src')
        page.wait_for_function(
            "src => { const img = document.querySelector('.d2l-dashboard img');"
            " return img && img.src != src && img.complete && img.naturalWidth > 200; }",
            arg=drawn)
    DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
    dashboard.screenshot(path=str(DOCS_SCREENSHOT))


OUTPUT = '.jp-Cell:nth-child(3) .jp-OutputArea'


def test_dashboard_follows_a_job_to_the_end(page, lab):
    tag = new_tag()
    dashboard = open_and_run(page, lab, 'dashboard.ipynb',
                             f'%launch -n 2 -s 2 --env D2L_TEST_TAG={tag} progress_job.py 3 12 0.2 -1')
    page.wait_for_function(      # live: both workers report, and their figure is drawn
        "document.querySelector('.d2l-dashboard').innerText.split('/3 · batch').length == 3"
        " && document.querySelector('.d2l-dashboard img').naturalWidth > 200")
    bars = page.eval_on_selector_all('.d2l-dashboard .progress-bar', 'els => els.length')
    assert bars == 2
    live = dashboard.inner_text()
    assert 'running' in live and '[worker' not in live      # the log is the cell's, not here
    screenshot(dashboard, 'dashboard.png')
    page.wait_for_selector('.d2l-dashboard', state='detached')   # the job ended
    page.wait_for_function(f"document.querySelector('{OUTPUT}').innerText"
                           ".includes('job finished after')")
    page.wait_for_function(f"document.querySelector('{OUTPUT} img') && "
                           f"document.querySelector('{OUTPUT} img').naturalWidth > 200")
    text = page.inner_text(OUTPUT)
    assert text.startswith(f'%launch -n 2 -s 2 --env D2L_TEST_TAG={tag}')   # the header line
    assert text.count('[worker 1] worker 1 done') == 1 and '@d2l/1' not in text   # once
    for label in ('scheduler', 'server 0', 'server 1', 'worker 0', 'worker 1'):
        assert re.search(fr'^ *{label} +localhost +finished +0\b', text, re.M), text
    assert text.count('100% epoch 3/3, batch 12/12') == 2
    screenshot(page.query_selector(OUTPUT), 'dashboard-finished.png')
    assert wait_no_survivors(tag) == []


def test_stop_button_stops_the_job(page, lab, request):
    tag = new_tag()
    dashboard = open_and_run(page, lab, 'stop.ipynb',
                             f'%launch -n 2 -s 2 --env D2L_TEST_TAG={tag} progress_job.py 1000 10 0.1 -1')
    page.wait_for_function(      # both workers are reporting progress
        "document.querySelector('.d2l-dashboard').innerText.split('/1000 · batch').length == 3")
    assert len(tagged_pids(tag)) >= 2 * NUM_PROCS   # guards and their commands
    screenshot(dashboard, 'dashboard-running.png')
    if request.config.getoption('--docs-screenshot'):     # the job runs until stopped
        docs_picture(page, dashboard)
    page.click('.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]')
    pressed = time.monotonic()
    page.wait_for_function(f"document.querySelector('{OUTPUT}').innerText"
                           ".includes('job stopped after')")
    page.wait_for_selector('.jp-Cell:nth-child(3) .jp-OutputArea-output:has-text("KeyboardInterrupt")')
    assert wait_no_survivors(tag, timeout=10) == []
    assert time.monotonic() - pressed < 10
    text = page.inner_text(OUTPUT)
    assert len(re.findall(r'^ *(scheduler|server \d|worker \d) +localhost +stopped\b', text,
                          re.M)) == NUM_PROCS
    assert page.query_selector('.d2l-dashboard') is None
    screenshot(page.query_selector(OUTPUT), 'dashboard-stopped.png')
