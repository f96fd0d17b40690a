"""Shared by the notebook tests: a tiny job that reports progress, notebook building, and
the scripts the chapters write."""

import nbformat

from support import ROOT, load_script

CHAPTERS = ROOT / 'notebooks'

# A worker that "trains" for num_epochs x num_batches steps of `delay` seconds and
# reports like a real training script; the worker of rank fail_rank fails early.
JOB_SCRIPT = '''\
import sys, time
import d2ldist

num_epochs, num_batches, delay, fail_rank = 2, 5, 0.02, -1
if len(sys.argv) > 1:
    num_epochs, num_batches = int(sys.argv[1]), int(sys.argv[2])
    delay, fail_rank = float(sys.argv[3]), int(sys.argv[4])
d2ldist.init()
rank = d2ldist.rank()
print(f'worker {rank} starts', flush=True)
steps = {'read': 1, 'compute': 4, 'aggregate': 1, 'to cpu': 0.5, 'push': 2, 'pull': 2, 'to device': 0.5}
for epoch in range(1, num_epochs + 1):
    for batch in range(1, num_batches + 1):
        time.sleep(delay)
        if rank == fail_rank and epoch == 1 and batch == 2:
            print(f'worker {rank}: something broke', flush=True)
            sys.exit(3)
        done = (epoch - 1) * num_batches + batch
        d2ldist.report(epoch=epoch, num_epochs=num_epochs, batch=batch, num_batches=num_batches,
                       loss=2.3 / (1 + 0.3 * done) + 0.02 * rank, acc=min(0.95, 0.1 + 0.08 * done),
                       samples=64 * done, step_times={k: v * delay / 11 * (1 + 0.2 * rank)
                                                      for k, v in steps.items()})
    d2ldist.report(test_acc=min(0.9, 0.3 + 0.25 * epoch))
print(f'worker {rank} done', flush=True)
'''


def notebook(*sources):
    """A notebook of code cells with these sources."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'Python 3',
                                 'language': 'python'}
    return nb


def stream_text(cell):
    """Everything a cell printed on stdout and stderr."""
    return ''.join(o.get('text', '') for o in cell.get('outputs', []) if o.output_type == 'stream')


def load_book():
    """book/build.py as a module (it is a script, not part of the package)."""
    return load_script('book/build.py', 'book_build')


def written_script(chapter, name):
    """What the chapter's ``%%writefile name`` cell writes: the script exists only once the
    chapter has run (git ignores it), and a test may run before the chapters do."""
    head = f'%%writefile {name}'
    for cell in nbformat.read(CHAPTERS / chapter, as_version=4).cells:
        if cell.cell_type == 'code' and cell.source.splitlines()[:1] == [head]:
            return cell.source.split('\n', 1)[1] + '\n'      # (as IPython writes it)
    raise LookupError(f'{chapter} has no {head} cell')
