"""Optimizers that run on the servers, chosen by name: no code travels, only a name and numbers.

Each one updates a weight in place from a gradient, with the very formulas (and the
order of floating-point operations) of ``torch.optim``, so that a parameter server
and a single process running torch.optim reach the same weights.
The servers receive the *sum* of the workers' gradients and divide it by the number
of workers (the average), or multiply it by ``rescale_grad`` (MXNet's name) if given.
"""
import torch


class SGD:
    """torch.optim.SGD: momentum, dampening, nesterov, weight decay."""
    defaults = dict(lr=0.01, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
    state_names, required = ('momentum_buffer',), ()

    def __init__(self, **hyper):
        self.hyper = hyper

    def init_state(self, w):
        return {}

    def update(self, w, grad, state):
        lr, momentum, dampening, wd, nesterov = (self.hyper[k] for k in (
            'lr', 'momentum', 'dampening', 'weight_decay', 'nesterov'))
        if wd != 0:
            grad = grad.add(w, alpha=wd)
        if momentum != 0:
            buf = state.get('momentum_buffer')
            if buf is None:
                buf = state['momentum_buffer'] = torch.clone(grad).detach()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        w.add_(grad, alpha=-lr)


class Adam:
    """torch.optim.Adam (with L2 weight decay, as torch's Adam does it)."""
    defaults = dict(lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    state_names = required = ('step', 'exp_avg', 'exp_avg_sq')

    def __init__(self, **hyper):
        self.hyper = hyper

    def init_state(self, w):
        return {'step': 0, 'exp_avg': torch.zeros_like(w), 'exp_avg_sq': torch.zeros_like(w)}

    def update(self, w, grad, state):
        lr, beta1, beta2, eps, wd = (self.hyper[k] for k in (
            'lr', 'beta1', 'beta2', 'eps', 'weight_decay'))
        state['step'] += 1
        if wd != 0:
            grad = grad.add(w, alpha=wd)
        state['exp_avg'].lerp_(grad, 1 - beta1)
        state['exp_avg_sq'].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** state['step'])
        bias_correction2_sqrt = (1 - beta2 ** state['step']) ** 0.5
        denom = (state['exp_avg_sq'].sqrt() / bias_correction2_sqrt).add_(eps)
        w.addcdiv_(state['exp_avg'], denom, value=-step_size)


OPTIMIZERS = {'sgd': SGD, 'adam': Adam}


def create(name, **hyper):
    """The optimizer called ``name`` with checked hyperparameters (numbers only)."""
    if name not in OPTIMIZERS:
        raise ValueError(f'unknown optimizer {name!r}; known: {", ".join(OPTIMIZERS)}')
    cls = OPTIMIZERS[name]
    allowed = dict(cls.defaults, rescale_grad=None)
    unknown = set(hyper) - set(allowed)
    if unknown:
        raise ValueError(f'optimizer {name!r} has no hyperparameter {", ".join(sorted(unknown))}; '
                         f'it takes {", ".join(allowed)}')
    for k, v in hyper.items():
        if not isinstance(v, (int, float)):
            raise ValueError(f'hyperparameter {k} must be a number, got {v!r}')
    return cls(**dict(allowed, **hyper))


class Updater:
    """Applies an optimizer to keys: keeps one state per key, rescales the summed gradient."""

    def __init__(self, name, num_workers=1, **hyper):
        self.name, self.opt = name, create(name, **hyper)
        self.num_workers, self.states = num_workers, {}

    def __call__(self, key, w, grad_sum):
        """Update ``w`` in place from the sum of the pushed gradients."""
        if key not in self.states:
            self.states[key] = self.opt.init_state(w)
        rescale = self.opt.hyper['rescale_grad']
        grad = grad_sum / self.num_workers if rescale is None else grad_sum * rescale
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
