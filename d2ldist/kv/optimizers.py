"""Optimizers by name: the one table of those d2ldist knows, and the ones the servers run.

``OPTIMIZERS`` says which optimizers exist: for each name, the torch.optim class a
worker runs, and the class here that the servers run (None: on the workers only);
``create`` makes either.
No code travels to a server, only a name and numbers. The servers' classes update a
weight in place from a gradient with the very formulas (and the order of
floating-point operations) of ``torch.optim``, so that a parameter server and a
single process running torch.optim reach the same weights. The servers receive the
*sum* of the workers' gradients and multiply it by ``rescale_grad``, 1 unless given,
as in MXNet: to update with the average over N workers, ``kv.set_optimizer(...,
rescale_grad=1 / kv.num_workers)``. (The Trainer averages before it pushes -- it divides
by all workers' examples in step 2, as DistributedDataParallel averages -- and passes
rescale_grad=1.) ``multi_precision=True`` keeps a float32 master copy of float16 and
bfloat16 weights on the servers (MXNet's name): the update runs in float32, the
weights the workers pull are its rounding.

Hyperparameters have one vocabulary, torch.optim's keyword arguments (``lr``,
``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``betas``, ``eps``), and
``rescale_grad`` and ``multi_precision`` for the servers. torch's because the Trainer documents them, a worker
hands them to torch.optim as they are and the servers copy torch.optim's formulas: below
the door they come in by, nothing is renamed (JSON carries ``betas`` as a pair).
``torch_names`` converts gluon's and MXNet's spellings (``learning_rate``, ``wd``,
``beta1``, ``beta2``) at those doors: ``kv.set_optimizer`` and the Trainer.
"""
import torch

# gluon's and MXNet's names for torch's (beta1 and beta2 become betas)
GLUON_NAMES = {'learning_rate': 'lr', 'wd': 'weight_decay'}


def torch_names(hyper):
    """Hyperparameters in torch.optim's names: gluon's learning_rate, wd, beta1, beta2 renamed."""
    hyper = {GLUON_NAMES.get(k, k): v for k, v in (hyper or {}).items()}
    if 'beta1' in hyper or 'beta2' in hyper:
        hyper['betas'] = (hyper.pop('beta1', 0.9), hyper.pop('beta2', 0.999))
    return hyper


class SGD:
    """torch.optim.SGD: momentum, dampening, nesterov, weight decay."""
    defaults = dict(lr=0.01, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
    state_names, required = ('momentum_buffer',), ()

    def __init__(self, **hyper):
        self.hyper = hyper
        self._scratch = torch.empty(0)

    def init_state(self, w):
        return {}

    def update(self, w, grad, state):
        lr, momentum, dampening, wd, nesterov = (self.hyper[k] for k in (
            'lr', 'momentum', 'dampening', 'weight_decay', 'nesterov'))
        if wd != 0:
            grad = torch.add(grad, w, alpha=wd, out=self.scratch(grad))
        if momentum != 0:
            buf = state.get('momentum_buffer')
            if buf is None:
                buf = state['momentum_buffer'] = torch.clone(grad).detach()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = torch.add(grad, buf, alpha=momentum, out=self.scratch(grad)) \
                if nesterov else buf
        w.add_(grad, alpha=-lr)

    def scratch(self, like):
        """One reused buffer shaped like ``like``, for what torch.optim computes into a
        new tensor (``grad + wd * w``): a new one every step costs as much as the update
        itself (45 MB: 16 ms of page faults on this machine), the same numbers come out."""
        n = like.numel()
        if self._scratch.numel() < n or self._scratch.dtype != like.dtype \
                or self._scratch.device != like.device:
            self._scratch = torch.empty(n, dtype=like.dtype, device=like.device)
        return self._scratch[:n].view_as(like)


class Adam:
    """torch.optim.Adam (with L2 weight decay, as torch's Adam does it)."""
    defaults = dict(lr=0.001, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    state_names = required = ('step', 'exp_avg', 'exp_avg_sq')

    def __init__(self, **hyper):
        self.hyper = hyper

    def init_state(self, w):
        return {'step': 0, 'exp_avg': torch.zeros_like(w), 'exp_avg_sq': torch.zeros_like(w)}

    def update(self, w, grad, state):
        lr, (beta1, beta2), eps, wd = (self.hyper[k] for k in (
            'lr', 'betas', 'eps', 'weight_decay'))
        state['step'] += 1
        if wd != 0:
            grad = grad.add(w, alpha=wd)
        state['exp_avg'].lerp_(grad, 1 - beta1)
        state['exp_avg_sq'].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** state['step'])
        bias_correction2_sqrt = (1 - beta2 ** state['step']) ** 0.5
        denom = (state['exp_avg_sq'].sqrt() / bias_correction2_sqrt).add_(eps)
        w.addcdiv_(state['exp_avg'], denom, value=-step_size)


# Every optimizer d2ldist knows: name -> (torch.optim's class, the servers' class or None)
OPTIMIZERS = {'sgd': (torch.optim.SGD, SGD),
              'adam': (torch.optim.Adam, Adam),
              'adamw': (torch.optim.AdamW, None)}
ON_SERVERS = [name for name, (_, on_servers) in OPTIMIZERS.items() if on_servers]


def create(name, hyper, params=None):
    """The optimizer called ``name`` (in OPTIMIZERS), ``hyper`` in torch.optim's names:
    torch.optim's over ``params``, as a worker runs it; without ``params``, the servers'
    own, ``hyper`` checked first (it came over the network: numbers only).

    A worker's is torch's plain kernel, one operation after another, unless ``hyper``
    asks for ``fused=True``: it rounds exactly as the servers' formulas do, so the ring
    and the parameter server train the same model. torch's fused kernel is faster (one
    pass over the memory: 9 ms instead of 35 for a ResNet-18's 45 MB) but on CPUs with
    AVX it rounds a few elements differently, and training amplifies that last bit.
    """
    if params is not None:
        if name not in OPTIMIZERS:
            raise ValueError(f'unknown optimizer {name!r}: use one of {sorted(OPTIMIZERS)}')
        return OPTIMIZERS[name][0](params, **hyper)
    if name not in ON_SERVERS:
        raise ValueError(f'unknown optimizer {name!r}; the servers run {", ".join(ON_SERVERS)}')
    cls = OPTIMIZERS[name][1]
    allowed = dict(cls.defaults, rescale_grad=1.0, multi_precision=False)
    unknown = set(hyper) - set(allowed)
    if unknown:
        raise ValueError(f'optimizer {name!r} has no hyperparameter {", ".join(sorted(unknown))}; '
                         f'it takes {", ".join(allowed)}')
    for k, v in hyper.items():
        numbers = v if k == 'betas' and isinstance(v, (list, tuple)) and len(v) == 2 else [v]
        if not all(isinstance(x, (int, float)) for x in numbers):
            raise ValueError(f'hyperparameter {k} must be a number (betas: two), got {v!r}')
    return cls(**dict(allowed, **hyper))


class Updater:
    """Applies an optimizer to keys: keeps one state per key, rescales the summed gradient."""

    def __init__(self, name, **hyper):
        self.name, self.opt, self.states = name, create(name, hyper), {}
        self.masters = {}        # key -> float32 copy of a half-precision weight

    def __call__(self, key, w, grad_sum):
        """Update ``w`` in place from the sum of the pushed gradients (times rescale_grad)."""
        rescale = self.opt.hyper['rescale_grad']
        grad = grad_sum * rescale if rescale != 1 else grad_sum
        if self.opt.hyper['multi_precision'] and w.dtype in (torch.float16, torch.bfloat16):
            master = self.masters.get(key)
            if master is None:
                master = self.masters[key] = w.float()
            self._update(key, master, grad.float())
            w.copy_(master)
        else:
            self._update(key, w, grad)

    def update_rows(self, key, w, positions, grad):
        """Update only ``w[positions]`` (and their optimizer state) from their gradient
        sum: a sparse key's lazy update, as MXNet's. The other rows, and their momenta,
        stay as they are -- weight decay included."""
        if key not in self.states:
            self.states[key] = self.opt.init_state(w)
        state = self.states[key]
        part = {k: (v[positions] if torch.is_tensor(v) else v) for k, v in state.items()}
        w_part = w[positions]
        rescale = self.opt.hyper['rescale_grad']
        self.opt.update(w_part, grad * rescale if rescale != 1 else grad, part)
        w[positions] = w_part
        for k, v in part.items():
            if torch.is_tensor(v):
                if k not in state:                 # created by this update (a momentum)
                    state[k] = torch.zeros_like(w)
                state[k][positions] = v
            else:
                state[k] = v

    def _update(self, key, w, grad):
        if key not in self.states:
            self.states[key] = self.opt.init_state(w)
        self.opt.update(w, grad, self.states[key])

    def load_state(self, key, state, numel):
        """Take a saved state for ``key`` after checking it fits this optimizer."""
        names, opt = set(state), self.opt
        if not set(opt.required) <= names <= set(opt.state_names):
            raise ValueError(f'key {key!r}: state {sorted(names)} is not a state of '
                             f'{self.name} (it has {", ".join(opt.state_names)})')
        for name, v in state.items():
            if getattr(v, 'numel', lambda: numel)() != numel:
                raise ValueError(f'key {key!r}: state {name} has {v.numel()} elements, '
                                 f'the key {numel}')
        self.states[key] = state
