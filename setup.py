"""The build's one step that pyproject.toml cannot say: the package ``d2ldist.chapters``
(the folder notebooks/) ships its chapters and figures, not notebooks/run.py, the tool
that re-executes them in a clone (``make notebooks``). Everything else is in pyproject.toml.
"""
from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """setuptools' build_py, less the Python files of ``d2ldist.chapters``: data only."""

    def find_package_modules(self, package, package_dir):
        if package == 'd2ldist.chapters':
            return []
        return super().find_package_modules(package, package_dir)


setup(cmdclass={'build_py': BuildPy})
