"""Which servers hold each shard of the key-value store (``d2l-launch --server-replicas R``).

Shard s is what server s holds (``kv/placement.py`` says which keys). With R replicas
it is held by the next R servers around the ring too, in order -- its chain:

    S = 3, R = 1   ->  shard 0: [server 0, server 1]   shard 1: [server 1, server 2]
                       shard 2: [server 2, server 0]

The first holder, the chain's head, answers the workers; every change goes down the
chain, and is answered only once the last holder has it (``kv/replication.py``). When a
server is lost it leaves every chain it was in, so the next holder of its shard becomes
that shard's head, and the next live server after its last holder becomes a new one
(``renewed``): the holder before it sends it the shard whole (``kv/copies.py``). Until
it says it has it, it is ``copying``, no holder yet: a shard whose holders are all lost,
or only copying, is lost, and so is the job. Two losses need a new holder between them,
so at least R + 2 servers.
"""
from ..lines import shown


def chains(num_servers, replicas):
    """The holders of each shard, head first: [[node id, ...] for each shard]."""
    return [[f'server:{(shard + i) % num_servers}' for i in range(replicas + 1)]
            for shard in range(num_servers)]


def without(chains, lost, copying=()):
    """The chains once server ``lost`` is gone; None if a shard has no holder left (one
    still ``copying`` it, a set of (shard, server), does not count)."""
    left = [[holder for holder in chain if holder != lost] for chain in chains]
    return None if any(all((s, h) in copying for h in chain)
                       for s, chain in enumerate(left)) else left


def renewed(chains, live, replicas):
    """Each chain whole again: a shard with fewer than ``replicas`` + 1 holders takes the
    next ``live`` servers after its last holder, around the ring. The chains, and the
    new holders as (shard, server)."""
    count, new = len(chains), []
    for s, chain in enumerate(chains):
        last = int(chain[-1].split(':')[1])
        ring = [f'server:{(last + i) % count}' for i in range(1, count)]
        for server in [r for r in ring if r in live and r not in chain][
                :replicas + 1 - len(chain)]:
            chain.append(server)
            new.append((s, server))
    return chains, new


def takes_over(chains, left, lost):
    """In words, who answers for the lost server's shards now: 'server 1 answers for
    shard 0'."""
    taken = [f'{shown(left[s][0])} answers for shard {s}'
             for s, chain in enumerate(chains) if chain[0] == lost]
    return ', '.join(taken) or 'its shards keep their heads'


def copies(new):
    """In words, the new holders: 'server 2 gets a copy of shard 0'."""
    return ''.join(f', {shown(server)} gets a copy of shard {s}' for s, server in new)


def last_copy(chains, lost, copying, replicas):
    """In words, the shards whose last holder ``lost`` was, and what would have kept them."""
    shards = [str(s) for s, chain in enumerate(chains)
              if all(h == lost or (s, h) in copying for h in chain)]
    plural = 's' if len(shards) > 1 else ''
    return (f'{shown(lost)} held the last copy of shard{plural} {", ".join(shards)}: with '
            f'--server-replicas {replicas} a shard outlives {replicas} lost at once, and one '
            'more only once a new replica has its copy (a server outside its chain: -s '
            f'{replicas + 2} at least)')
