"""ZeRO stage 3 (FSDP's way): each layer's weights live sharded, gathered only while it computes.

Stages 1 and 2 (``sharded.py``) still keep every weight on every worker. Stage 3 keeps
none whole. ``shard_module(net)`` makes each *unit* of the net (by default each module
with parameters of its own, a Linear say; or the modules you name) hold one flat
shard instead of its parameters, laid out as ``sharded.py``'s buckets; worker r keeps
shard r as the unit's only parameter, ``flat_shard``, and a plain torch optimizer over
``net.parameters()`` steps the shards alone. Hooks all-gather a unit's weights before
its forward and again for its backward, and free them after; the autograd function
``Gather`` reduce-scatters its gradient into ``flat_shard.grad``. That optimizer's steps
count as ShardedOptimizer's do (``d2l-launch --fail``, ``--slow``, the timeline). Under
``--min-workers`` with ``--shard-replicas 1``, a TorchState of the net and that optimizer
keeps each unit's shard on the ring successor too (``shard_replica.py``).

Between steps a unit's ``weight`` is None; ``full_weights(net)`` gathers them all.
Start every worker with the same weights. One step drawn, its bytes, and how "free"
keeps autograd's views: docs/design/zero.md, "Stage 3".
"""
from collections.abc import Iterable

import torch
from torch import nn

from ..runtime import faults
from . import world
from .ops import Average
from .sharded import peak_moment

UNIT = 'sharded_unit'          # the attribute a unit's module carries (memory_by_kind reads it)


class Gather(torch.autograd.Function):
    """Forward: a unit's full flat weights, all-gathered from the shards. Backward: their
    gradient reduce-scattered into the shard's ``.grad``, and both freed."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        full = unit.all_gather(unit.empty())
        ctx.save_for_backward(full)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        full, = ctx.saved_tensors
        ctx.unit.reduce_scatter(grad_full)
        free(full)
        return None, None          # (the shard's gradient is already in its .grad)


class Unit:
    """One unit's parameters as one flat vector padded to a multiple of N, of which this
    worker keeps shard r; its hooks gather the weights around forward and backward."""

    def __init__(self, module, places, names, rank, n):
        self.module, self.places, self.names = module, places, names  # [(submodule, name)]
        params = [getattr(m, name) for m, name in places]
        self.shapes, self.numels = [p.shape for p in params], [p.numel() for p in params]
        self.dtype, self.device = params[0].dtype, params[0].device
        self.layout(n)
        flat = self.empty().zero_()
        torch.cat([p.detach().reshape(-1) for p in params], out=flat[:sum(self.numels)])
        self.shard = nn.Parameter(flat[slice(*self.cut(rank))].clone(),
                                  requires_grad=params[0].requires_grad)
        self.full = self.grad = None    # the gathered weights, their gradient: while computing
        for m, name in places:           # the module holds the shard, not its weights
            delattr(m, name)
        self.show([None] * len(places))
        module.register_parameter('flat_shard', self.shard)
        setattr(module, UNIT, self)
        module.register_forward_pre_hook(self.before_forward)
        module.register_forward_hook(self.after_forward)

    def layout(self, n):
        """The flat vector padded to a multiple of n, cut into n shards of ``shard_numel``."""
        self.padded = -(-sum(self.numels) // n) * n
        self.shard_numel = self.padded // n

    def cut(self, r):
        """(start, end) of worker r's shard in the flat vector."""
        return r * self.shard_numel, (r + 1) * self.shard_numel

    @torch.no_grad()
    def reshard(self, flat, rank, n):
        """Cut again for n workers from the whole flat weights (any padding): this worker's
        shard, in place of the old in the same Parameter (the optimizer holds it)."""
        self.layout(n)
        mine = self.empty().zero_()
        k = min(self.padded, flat.numel())
        mine[:k] = flat[:k]
        self.shard.data = mine[slice(*self.cut(rank))].clone()
        self.shard.grad = None

    def before_forward(self, module, args):
        """Forward pre-hook: the full weights gathered into the module's places."""
        self.full = Gather.apply(self.shard, self)
        self.show(self.views(self.full))
        peak_moment(self.module)

    def after_forward(self, module, args, output):
        """Forward hook: the weights freed, to be gathered again when backward reaches
        the output (the hook keeps this call's own flat: a unit may run twice)."""
        full = self.full
        if full.requires_grad:
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: self.regather(full))
        self.show([None] * len(self.places))
        free(full)

    def regather(self, full):
        """(Backward reached the output) the freed flat's memory back, all-gathered again."""
        if full.untyped_storage().nbytes() == 0:
            full.untyped_storage().resize_(self.padded * full.element_size())
            self.all_gather(full.data)   # (.data: autograd's saved views see no new version)

    def reduce_scatter(self, grad_full):
        """The full gradient, averaged over the workers, into this worker's shard's .grad."""
        self.grad = grad_full
        mine = world.run(world.backend().reduce_scatter_flat, grad_full, Average).wait()
        self.shard.grad = mine.clone() if self.shard.grad is None else self.shard.grad + mine
        peak_moment(self.module)
        self.grad = None

    def all_gather(self, flat):
        """Every worker's shard into ``flat``, in rank order. (Through a buffer of the
        collective's own: the ring reads and writes through numpy views, which fix the
        size of a tensor's memory for good, and ``flat``'s must come and go.)"""
        shards = world.run(world.backend().all_gather_flat_, self.empty(), self.shard.detach())
        return flat.copy_(shards.wait())

    def empty(self):
        return torch.empty(self.padded, dtype=self.dtype, device=self.device)

    def views(self, flat):
        """Each parameter's place in the flat vector, shaped like it (the padding left out)."""
        pieces = flat.split(self.numels + [self.padded - sum(self.numels)])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]

    def show(self, tensors):
        """Set each parameter's attribute (``weight``, ``bias``...) on its module."""
        for (m, name), t in zip(self.places, tensors):
            setattr(m, name, t)

    def __repr__(self):
        return f'Unit({", ".join(self.names)}: {sum(self.numels)} -> {self.padded} elements)'


def free(flat):
    """The flat tensor stays (autograd may hold views of it); its memory goes."""
    flat.untyped_storage().resize_(0)


def tensors(output):
    """The tensors in a module's output (a tensor, or tuples, lists, dicts of them)."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in tensors(o)]
    return []


def shard_module(net: nn.Module, units: Iterable[nn.Module] | None = None) -> nn.Module:
    """ZeRO stage 3 on ``net``, in place: each unit's weights cut into a flat shard per
    worker (``units``: modules of net, each taking the parameters under it that no unit
    inside it took; default: each module with parameters of its own). Returns net."""
    names = {m: name for name, m in net.named_modules()}
    if units is None:
        units = [m for m in net.modules() if next(m.parameters(recurse=False), None) is not None]
    units = list(units)
    check(net, units, names)
    backend, shards = world.backend(), {}
    for module in sorted(units, key=lambda m: -len(names[m].split('.'))):   # innermost first
        prefix = names[module] + '.' if names[module] else ''
        places = [(sub, pname, prefix + (sname + '.' if sname else '') + pname)
                  for sname, sub in module.named_modules()
                  for pname, p in sub.named_parameters(recurse=False) if id(p) not in shards]
        if not places:
            raise ValueError(f'unit {names[module] or "net"} has no parameters of its own to '
                             'shard: the units inside it took them all')
        kinds = {(getattr(s, p).dtype, getattr(s, p).device, getattr(s, p).requires_grad)
                 for s, p, _ in places}
        if len(kinds) > 1:
            raise ValueError(f'unit {names[module] or "net"} mixes dtypes, devices or frozen '
                             'parameters: make them units of their own')
        unit = Unit(module, [(s, p) for s, p, _ in places], [q for _, _, q in places],
                    backend.rank, backend.size)
        shards[id(unit.shard)] = unit.shard
    faults.watch(faults.StepClock(), shards.values())   # the steps of whatever steps them
    return net


def check(net, units, names):
    """Refuse, in one line, what shard_module cannot shard."""
    strangers = [type(m).__name__ for m in units if m not in names]
    if strangers:
        raise ValueError(f'the units must be modules of the net, not {", ".join(strangers)}')
    if len(set(map(id, units))) < len(units):
        raise ValueError('a unit is named twice')
    if any(hasattr(m, UNIT) for m in net.modules()):
        raise ValueError('the net is already sharded (shard_module runs once)')
    holders = {}
    for name, p in net.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(name)
    tied = [v for v in holders.values() if len(v) > 1]
    if tied:
        raise ValueError(f'shared parameters ({" = ".join(tied[0])}) cannot be sharded: '
                         'untie them')
    under = {id(p) for m in units for p in m.parameters()}
    left = [name for name, p in net.named_parameters() if id(p) not in under]
    if left:
        raise ValueError(f'{len(left)} parameters are in no unit ({", ".join(left[:3])}): '
                         'name a unit that holds them (the net itself, say)')


def units_of(net):
    """The units of a sharded net, in the order of its modules."""
    return [getattr(m, UNIT) for m in net.modules() if hasattr(m, UNIT)]


@torch.no_grad()
def full_weights(net):
    """Every unit's full weights, by the parameters' names before sharding (a collective:
    every worker calls it)."""
    out = {}
    for unit in units_of(net):
        flat = unit.all_gather(unit.empty())
        out.update(zip(unit.names, unit.views(flat)))
    return out
