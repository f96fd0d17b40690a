"""The examples: scripts that run alone or as every worker of a job.

In a clone they are files (``d2l-launch -n 2 -s 2 python examples/hello_roles.py``); a
pip install ships them as this package, so that the same scripts run anywhere as
modules, with no file to find:

    d2l-launch -n 2 -s 2 python -m d2ldist.examples.hello_roles
    python -m d2ldist.examples                 # lists them

Modules rather than one console command each: they are scripts to read and run under a
launcher (d2l-launch, %launch, torchrun -m), whose worker command ``python -m NAME`` runs
with the job's Python on every host, and they keep their top-level code as written.
"""
