"""The launcher: placement, the guard, the job supervisor and the ``d2l-launch`` CLI."""
from .cli import build_parser, main, parse, UsageError
from .job import Job, JobFailed, describe_exit
from .placement import ProcSpec, local_specs, place

__all__ = ['build_parser', 'main', 'parse', 'UsageError', 'Job', 'JobFailed',
           'describe_exit', 'ProcSpec', 'local_specs', 'place']
