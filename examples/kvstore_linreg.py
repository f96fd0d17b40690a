"""Linear regression trained through the parameter server (d2l's first model, distributed).

    d2l-launch -n 2 -s 2 python examples/kvstore_linreg.py

Every worker reads its own shard of the data, computes gradients on a minibatch and
pushes them; the servers average them and run SGD; every worker pulls the new weights.
"""
import torch
import d2ldist

true_w, true_b = torch.tensor([2.0, -3.4]), 4.2
lr, num_epochs, batch_size = 0.03, 3, 10

kv = d2ldist.kv.create('dist_sync')
g = torch.Generator().manual_seed(kv.rank)                 # each worker: its own shard
X = torch.normal(0, 1, (1000, 2), generator=g)
y = X @ true_w + true_b + torch.normal(0, 0.01, (1000,), generator=g)

net = torch.nn.Linear(2, 1)
params = list(net.parameters())
keys = [name for name, _ in net.named_parameters()]        # 'weight', 'bias'
kv.init(keys, [p.detach() for p in params])                # rank 0's values win
kv.pull(keys, out=[p.data for p in params])
kv.set_optimizer('sgd', lr=lr, rescale_grad=1 / kv.num_workers)   # servers update, average

for epoch in range(num_epochs):
    for i in range(0, len(X), batch_size):
        loss = ((net(X[i:i + batch_size]).squeeze(1) - y[i:i + batch_size]) ** 2 / 2).mean()
        net.zero_grad()
        loss.backward()
        kv.pushpull(keys, [p.grad for p in params], out=[p.data for p in params])
    with torch.no_grad():
        train_l = ((net(X).squeeze(1) - y) ** 2 / 2).mean()
    print(f'worker {kv.rank}: epoch {epoch + 1}, loss {train_l:f}')
print(f'worker {kv.rank}: w {net.weight.data.view(-1).tolist()}, b {net.bias.item():.3f}')
