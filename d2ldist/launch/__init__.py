"""Starting and watching whole jobs from your machine: ``d2l-launch``.

* ``cli.py``       -- d2l-launch's options (MXNet's tools/launch.py), and ``main``;
* ``processes.py`` -- which processes a job has, on which host, with what command and env;
* ``job.py``       -- start them, merge their output, stop them together;
* ``ssh.py``       -- the same over ssh: hosts, preflight, rsync, remote clean-up;
* ``slurm.py``     -- the same as one srun step inside a Slurm allocation;
* ``guard.py``     -- wraps every process and ends its group when the job ends;
* ``failwatch.py`` -- ``--fail`` as the launcher sees it (fired, or never);
* ``progress.py``  -- what we know of a running job (``JobModel``, fed by the job's hooks)
                     and d2l-launch's terminal view of it.

Kept light: every process of a job imports this package (the guard lives here).
"""
