"""Re-replication (``d2l-launch --server-replicas R``): a new holder for a shard that
lost one, after the Parameter Server paper (Li et al., OSDI 2014).

When a server is lost, the scheduler makes the next live server a new holder of each
shard that lost a holder (``runtime/replicas.py``). The holder before it in the chain
sends it the shard whole, in one message: every key's slice, the pushes each counts,
the optimizer and its state. The changes after it follow as to any holder
(``replication.py``). The new holder tells the scheduler it has the shard; from then
on a second loss finds it a holder:

    S = 3, R = 1, server 0 lost:  shard 0: [server 1] + server 2 (a copy from server 1)
                                  shard 2: [server 2] + server 1 (a copy from server 2)

More: docs/design/kv.md.
"""
from ..runtime import protocol
from ..runtime.van import Message
from . import messages as M
from .optimizers import Updater
from .server import Slot


class Copies:
    """The shards one server sends whole to a new holder, and takes whole as one."""

    def __init__(self, node):
        self.node = node

    def send(self, server):
        """Send the shard ``server`` holds, whole, to its chain's new next holder (copies
        of its memory: the rounds go on while the van sends it)."""
        store, updater = server.store, server.updater
        states, masters = (updater.states, updater.masters) if updater else ({}, {})
        entries, state_frames = M.state_entries(states)
        kept, master_frames = M.state_entries({k: {'master': t} for k, t in masters.items()})
        header = {'parts': [M.Part(k, s.dtype, s.shape, s.start, s.stop).head()
                            for k, s in store.items()],
                  'free': [k for k, s in store.items() if not s.optimizer],
                  'counted': [[k, sorted(s.counted.items())] for k, s in store.items()],
                  'optimizer': updater and [updater.name, dict(updater.opt.hyper)],
                  'entries': entries, 'masters': kept}
        frames = M.data([s.value for s in store.values()]) + state_frames + master_frames
        server.chain.send_copy(header, [bytes(f) for f in frames])

    def take(self, server, msg):
        """(the new holder) The shard whole, from the holder before: hold it as that one
        does, and tell the scheduler, which counts this server as a holder from now."""
        if server.chain.copied(msg, lambda m: self.restore(server, m)):
            self.node.send('scheduler', protocol.HOLDS, {'shard': server.shard})

    @staticmethod
    def restore(server, msg):
        """Make ``server``'s shard what the copy says (KVError if it is malformed)."""
        parts = msg.get('parts') if isinstance(msg.get('parts'), list) else []
        values = M.read_parts(_section(msg, {'parts': parts}, msg.frames[:len(parts)]), True)
        free, rest = msg.get('free') or [], msg.frames[len(parts):]
        server.store.clear()
        for p in values:
            server.store[p.key] = Slot(p.dtype, p.shape, p.start, p.stop, p.value.clone(),
                                       p.key not in free)
        for key, counted in msg.get('counted') or []:
            server.store[key].counted = {str(w): n for w, n in counted}
        server.updater = None
        if msg.get('optimizer'):
            name, hyper = msg['optimizer']
            server.updater = Updater(str(name), **dict(hyper))
            sizes = {key: slot.stop - slot.start for key, slot in server.store.items()}
            entries = msg.get('entries')
            tensors = sum(1 for e in entries if isinstance(e, list) and e[2:3] != [None])
            states = M.read_states(_section(msg, {'entries': entries}, rest[:tensors]), sizes)
            for key, state in states.items():
                server.updater.load_state(key, state, sizes[key])
            masters = M.read_states(_section(msg, {'entries': msg.get('masters')},
                                             rest[tensors:]), sizes)
            server.updater.masters = {key: state['master'] for key, state in masters.items()}


def _section(msg, header, frames):
    """A part of a copy, as a message of its own: ``read_parts`` and ``read_states`` read it."""
    return Message(msg.kind, msg.sender, header, list(frames))
