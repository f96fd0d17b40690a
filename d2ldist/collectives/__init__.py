"""Collectives among the workers, without servers (docs/design/ring.md, collectives.md).

* ``world.py``   -- the backend in use, rank and size (the job's state; light);
* ``ring.py``    -- the ring all-reduce (reduce-scatter, then all-gather), broadcast, all-gather;
  ``link.py``: one call's chunks to and from the neighbours, checked (what is not this
  call's kept aside); ``join.py``: Horovod's join(), taking part with stand-ins;
* ``engine.py``  -- the communication thread; ``compressed.py``: the one all-reduce it runs
  for the stores and the Horovod face (through compression, if any);
* ``ops.py``     -- the reductions: Sum, Average, Min, Max;
* ``api.py``     -- allreduce, broadcast, allgather, barrier with Horovod's names, on
  one communication thread; ``ring_backend.py``: them on the ring (and join()'s
  stand-ins); ``torch_backend.py``: the same on torch.distributed;
* ``sync_batchnorm.py`` -- BatchNorm over the batches of all workers;
* ``buckets.py`` -- gradient buckets whose all-reduce starts during backward;
* ``distributed_optimizer.py`` -- Horovod's DistributedOptimizer and broadcasts;
* ``sharded.py`` -- ZeRO stages 1 and 2: ShardedOptimizer, the optimizer's state (and
  the gradients) cut into one shard per worker; memory_by_kind, the bytes each holds;
* ``sharded_module.py`` -- ZeRO stage 3: shard_module, the weights sharded too, each
  layer's gathered only while it computes.
"""
