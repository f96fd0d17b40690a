"""The runtime every node stands on: messages, tensors on the wire, and the job's bookkeeping.

* ``van.py``       -- authenticated messages over ZeroMQ (``protocol.py``: control kinds);
* ``wire.py``      -- tensors on the wire: a JSON description and one raw frame;
* ``shm.py``       -- big frames between processes of one host through shared memory;
* ``staging.py``   -- copies between GPUs and pinned host memory; the flat tensor a
  collective runs on (used by kv, collectives and the Trainer);
* ``pacing.py``    -- a simulated link per process (--bandwidth, --latency);
* ``split.py``     -- cutting n things into k even parts (ring segments, server slices);
* ``scheduler.py`` -- registration, address book, barriers, liveness (its own process);
* ``node.py``      -- a node's handle on the job: rank, peers, send/recv, barriers;
* ``faults.py``    -- stragglers and failures on demand (d2l-launch --slow, --fail).
"""
