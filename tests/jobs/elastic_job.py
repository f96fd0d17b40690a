"""Elastic training on the ring (hvd.elastic), deterministic, for test_elastic.py.

A linear model in float64 learns from STEPS global batches of BATCH samples (one
epoch); each worker trains on its part of the global batch (``elastic.part``: 4, 3, 3
of 10 with three workers, 5, 5 with two, so the average of the parts' gradients depends
on the membership), commits after every step, and the learning rate follows the number
of workers (Horovod's on_reset idiom). Each worker prints where it entered ``train``
(the batch and its rank among how many), the samples it read from there, and its final
weights. With ``RAISE_ON=R`` worker R raises an error at batch 20 instead of being killed.
``replay(sizes)`` computes the same in one process, for any sequence
of memberships.

``elastic_job.py sampler``: a DataLoader of batches of LOCAL samples from an
``ElasticSampler`` instead (in order: the global batch is LOCAL times the workers, each
worker's samples interleaved), until the epoch's samples are read; ``replay_sampler``.

    d2l-launch -n 3 -s 0 --min-workers 2 --fail worker:1@step=40 python elastic_job.py
"""
import json
import os

import torch

STEPS, BATCH, FEATURES, LR = 100, 10, 5, 0.02
LOCAL = 4          # a worker's batch, with the sampler


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH, FEATURES, generator=g, dtype=torch.float64)
    y = x @ torch.arange(1.0, FEATURES + 1, dtype=torch.float64) + 0.5 \
        + 0.1 * torch.randn(STEPS * BATCH, generator=g, dtype=torch.float64)
    return x, y


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1).double()


def loss_of(net, x, y, rows):
    a, b = rows
    return ((net(x[a:b]).squeeze(1) - y[a:b]) ** 2).mean()


def weights(net):
    return [float(v) for v in torch.cat([p.detach().reshape(-1) for p in net.parameters()])]


def replay(sizes):
    """The final weights in one process; ``sizes[b]``: the workers that train batch b."""
    from d2ldist.runtime.split import even_slices
    x, y = data()
    net = model()
    for b, n in enumerate(sizes):
        grads = []
        for a, c in even_slices(BATCH, n):
            net.zero_grad()
            loss_of(net, x, y, (b * BATCH + a, b * BATCH + c)).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                p -= LR * n * sum(g[i] for g in grads) / n
    return weights(net)


def replay_sampler(steps):
    """The final weights in one process, with the sampler; ``steps``: how many global
    batches three workers read before two went on."""
    x, y = data()
    net = model()
    read, step = 0, 0
    while read < len(x):
        n = 3 if step < steps else 2
        chunk = torch.arange(read, min(read + LOCAL * n, len(x)))
        grads = []
        for r in range(n):
            net.zero_grad()
            rows = chunk[r::n]
            ((net(x[rows]).squeeze(1) - y[rows]) ** 2).mean().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                p -= LR * n * sum(g[i] for g in grads) / n
        read, step = read + LOCAL * n, step + 1
    return weights(net)


def start():
    """The job's model, optimizer (the learning rate follows the workers) and state."""
    import d2ldist.horovod as hvd
    torch.set_num_threads(1)
    hvd.init()
    net = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR * hvd.size()),
                                         named_parameters=net.named_parameters())

    def on_reset():
        for group in optimizer.param_groups:
            group['lr'] = LR * hvd.size()
    return hvd, net, optimizer, on_reset


def run(hvd, net, state, on_reset, entered, epoch):
    """Train under hvd.elastic.run: ``epoch(state)`` reads this worker's part of what is
    left and returns the samples it read; each (re)entry says where it began
    (``entered()``), and the end the samples read and the final weights."""
    me = os.environ.get('D2L_RANK', '0')
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        print(f'worker {me}: enters at {entered()} as rank {hvd.rank()} of {hvd.size()}',
              flush=True)
        print(f'worker {me} read {json.dumps(epoch(state))}', flush=True)

    train(state)
    print(f'worker {me} done: {json.dumps(weights(net))}', flush=True)


def main_sampler():
    hvd, net, optimizer, on_reset = start()
    x, y = data()
    sampler = hvd.elastic.ElasticSampler(range(len(x)), shuffle=False)
    loader = torch.utils.data.DataLoader(range(len(x)), batch_size=LOCAL, sampler=sampler)
    state = hvd.elastic.TorchState(model=net, optimizer=optimizer, sampler=sampler, batch=0)

    def epoch(state):
        read = []
        for rows in loader:
            read += rows.tolist()
            optimizer.zero_grad()
            ((net(x[rows]).squeeze(1) - y[rows]) ** 2).mean().backward()
            optimizer.step()
            sampler.record_batch(state.batch, LOCAL)
            state.batch += 1
            state.commit()
        return read

    run(hvd, net, state, on_reset, lambda: f'sample {sampler.processed}', epoch)


def main():
    hvd, net, optimizer, on_reset = start()
    me = os.environ.get('D2L_RANK', '0')
    x, y = data()
    state = hvd.elastic.TorchState(model=net, optimizer=optimizer, batch=0)

    def epoch(state):
        read = []
        while state.batch < STEPS:
            if me == os.environ.get('RAISE_ON') and state.batch == 20:
                raise ValueError('worker 1 stops at batch 20 (RAISE_ON)')
            a, b = hvd.elastic.part(BATCH)
            rows = (state.batch * BATCH + a, state.batch * BATCH + b)
            read += range(*rows)
            optimizer.zero_grad()
            loss_of(net, x, y, rows).backward()
            optimizer.step()
            state.batch += 1
            state.commit()
        return read

    run(hvd, net, state, on_reset, lambda: f'batch {state.batch}', epoch)


if __name__ == '__main__':
    import sys
    main_sampler() if sys.argv[1:] == ['sampler'] else main()
