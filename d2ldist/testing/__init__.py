"""What the tests and the benchmarks share, so that neither imports the other's files.

- ``comm_step.py``: one synchronous step of communication (the parameter server, the
  ring, gloo) on ResNet-18's gradients, timed inside a job: what the scaling study
  (benchmarks/scaling.py and its chapter), its tests and benchmarks/between_hosts.py
  measure;
- ``netns_hosts.py``: several "machines" on one, network namespaces with sshd (needs
  root), for the ssh tests and benchmarks/between_hosts.py;
- ``slurm_cluster.py``: a real Slurm on one machine (munged, slurmctld, two slurmd in
  such namespaces; needs root), for tests/system/test_slurm.py.
"""
