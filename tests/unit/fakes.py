"""Stand-ins for the network in one-process tests: a van that keeps what is sent, a
scheduler of N registered workers on it, and a received message."""
from d2ldist.runtime.scheduler import Scheduler
from d2ldist.runtime.van import Message


class FakeVan:
    """Keeps every (peer, kind, header) sent."""

    def __init__(self):
        self.sent, self.given_up = [], []

    def send(self, peer, kind, header=None, frames=()):
        self.sent.append((peer, kind, header))

    def give_up_on(self, peer):
        self.given_up.append(peer)


def scheduler(workers=3):
    """A scheduler whose workers have all registered (the address book went out)."""
    s = Scheduler(FakeVan(), workers, 0)
    s.nodes = {f'worker:{r}': f'tcp://w{r}' for r in range(workers)}
    s.starts = {node: 1 for node in s.nodes}
    s.book_sent = True
    return s


def message(kind, sender, **header):
    """A message as the van delivers it, without frames."""
    return Message(kind, sender, header, [])
