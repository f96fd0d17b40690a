"""Execute the chapters in place, from a clean directory, and save them with their outputs.

    python notebooks/run.py                       # every notebook in notebooks/
    python notebooks/run.py ring_allreduce_scratch.ipynb ...

Each notebook runs in a fresh kernel with notebooks/ as its working directory, after
the files its ``%%writefile`` cells write (and their logs) have been removed, so a
run never depends on an earlier one. The kernel imports the d2ldist of this
checkout. Widget state is not stored: a finished %launch leaves plain outputs (its
summary and figure) that every viewer shows, and the chapters stay light.
"""
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TIMEOUT = 900     # seconds per cell at most


def written_files(nb):
    """The files the notebook writes with %%writefile (removed before a run)."""
    names = set()
    for cell in nb.cells:
        m = re.match(r'%%writefile\s+(?:-a\s+)?(\S+)', cell.source) if cell.cell_type == 'code' else None
        if m:
            names.add(m.group(1))
    return names


def run(path):
    """Execute one notebook in place; returns the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    for name in written_files(nb):
        for stale in (HERE / name, (HERE / name).with_suffix('.log')):
            if stale.is_file():
                stale.unlink()
    client = NotebookClient(nb, timeout=TIMEOUT, kernel_name='python3',
                            resources={'metadata': {'path': str(HERE)}},
                            store_widget_state=False)
    start = time.time()
    try:
        client.execute()
    finally:
        nb.metadata.pop('widgets', None)   # an earlier save's widget state is stale
        nbformat.write(nb, path)      # even a failed run is kept, to look at
    return time.time() - start


def main(names):
    os.environ['PYTHONPATH'] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p])
    paths = [HERE / n for n in names] if names else sorted(HERE.glob('*.ipynb'))
    total = 0.0
    for path in paths:
        seconds = run(path)
        total += seconds
        print(f'{path.name}: {seconds:.0f} s', flush=True)
    print(f'all {len(paths)} notebooks: {total:.0f} s')


if __name__ == '__main__':
    main(sys.argv[1:])
