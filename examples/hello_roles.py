"""Hello, roles: the smallest job that shows scheduler, servers and workers talking.

    d2l-launch -n 2 -s 2 python examples/hello_roles.py
    python examples/hello_roles.py            # alone: rank 0 of 1

Each worker joins the job, looks up the address book, passes a token round the ring
of workers (rank r sends to rank r+1) and meets the others at a barrier.
"""
import d2ldist

node = d2ldist.init()
rank, num_workers = d2ldist.rank(), d2ldist.size()
print(f'worker {rank} of {num_workers} is up')
if node is not None:
    servers = node.peers('server')
    print(f'worker {rank} sees {len(servers)} servers: {", ".join(servers) or "none"}')
    if num_workers > 1:
        right = f'worker:{(rank + 1) % num_workers}'
        node.send(right, 'token', {'text': f'hello from worker {rank}'})
        msg = node.recv(['token'])
        print(f'worker {rank} got "{msg["text"]}" from {msg.sender}')
d2ldist.barrier()
print(f'worker {rank} passed the barrier')
