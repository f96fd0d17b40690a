"""Which servers hold each shard of the key-value store (``d2l-launch --server-replicas R``).

Shard s is what server s holds (``kv/placement.py`` says which keys). With R replicas
it is held by the next R servers around the ring too, in order -- its chain:

    S = 3, R = 1   ->  shard 0: [server 0, server 1]   shard 1: [server 1, server 2]
                       shard 2: [server 2, server 0]

The first holder, the chain's head, answers the workers; every change goes down the
chain, and is answered only once the last holder has it (``kv/replication.py``). When a
server is lost it leaves every chain it was in, so the next holder of its shard becomes
that shard's head. A shard whose holders are all lost is lost, and so is the job.
"""
from ..lines import shown


def chains(num_servers, replicas):
    """The holders of each shard, head first: [[node id, ...] for each shard]."""
    return [[f'server:{(shard + i) % num_servers}' for i in range(replicas + 1)]
            for shard in range(num_servers)]


def without(chains, lost):
    """The chains once server ``lost`` is gone; None if a shard has no holder left."""
    left = [[holder for holder in chain if holder != lost] for chain in chains]
    return None if any(not chain for chain in left) else left


def takes_over(chains, left, lost):
    """In words, who answers for the lost server's shards now: 'server 1 answers for
    shard 0'."""
    taken = [f'{shown(left[s][0])} answers for shard {s}'
             for s, chain in enumerate(chains) if chain[0] == lost]
    return ', '.join(taken) or 'its shards keep their heads'
