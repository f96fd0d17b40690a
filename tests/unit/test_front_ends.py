"""Which front ends get %launch's live dashboard: those whose shell can show widgets.

Shells are made without their ``__init__`` (which would want a running kernel or
terminal): what the check looks at is the class and the kernel, nothing else. VS Code,
JupyterLab and Notebook use ipykernel's ZMQInteractiveShell itself; Colab a subclass.
"""
from types import SimpleNamespace

import pytest

from d2ldist.launch.processes import local_specs
from d2ldist.launch.progress import JobModel
from d2ldist.notebook.magic import _TextView, _view, widgets_possible

zmqshell = pytest.importorskip('ipykernel.zmqshell')
from IPython.terminal.interactiveshell import TerminalInteractiveShell  # noqa: E402


class Shell(zmqshell.ZMQInteractiveShell):
    """As Colab's google.colab._shell.Shell: a subclass, with a name of its own."""


class ZMQInteractiveShell(TerminalInteractiveShell):
    """A terminal shell that merely bears the kernel shell's name."""


def bare(cls):
    return cls.__new__(cls)


def model():
    return JobModel(local_specs(2, 1, ['true'], 'secret'), title='%launch -n 2 job.py')


def test_a_subclass_of_the_kernels_shell_gets_the_dashboard():
    pytest.importorskip('ipywidgets')
    from d2ldist.notebook.dashboard import Dashboard
    colab = bare(Shell)
    assert type(colab).__name__ != 'ZMQInteractiveShell'     # the old check said no
    assert widgets_possible(colab)
    assert isinstance(_view(model(), colab), Dashboard)


def test_a_kernel_of_another_make_with_comms_gets_widgets():
    shell = SimpleNamespace(kernel=SimpleNamespace(comm_manager=object()))
    assert widgets_possible(shell)


@pytest.mark.parametrize('cls', [TerminalInteractiveShell, ZMQInteractiveShell])
def test_a_terminal_shell_gets_the_text_form(cls):
    terminal = bare(cls)
    assert not widgets_possible(terminal)
    view = _view(model(), terminal)
    assert isinstance(view, _TextView)
    assert repr(view).startswith('%launch -n 2 job.py: scheduler, 1 server, 2 workers')


def test_no_kernel_no_comm_manager_no_widgets():
    assert not widgets_possible(SimpleNamespace(kernel=None))
    assert not widgets_possible(SimpleNamespace(kernel=SimpleNamespace(comm_manager=None)))
