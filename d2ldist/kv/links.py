"""The streams a server answers some workers on (``runtime/stream.py``).

A worker whose answers would cross a socket (another host, D2L_SHM=0) offers the
server a stream of its own; the VALUES of whole slices go there and are read in
place, straight into the worker's ``out``. If a stream cannot open, or breaks, the
answers go through the van. One ``Links`` serves every shard a server holds.
"""
from .. import lines
from ..runtime import stream


class Links:
    """A server's streams, worker -> the stream its VALUES go on."""

    def __init__(self, node):
        self.node, self.streams = node, {}

    def offer(self, msg):
        """Open the stream a worker offers, where its answers would cross a socket."""
        worker, offer = msg.sender, msg.get('offer')
        if not (self.node.van.through_socket(worker) and isinstance(offer, dict)):
            return
        try:
            self.streams[worker] = stream.connect(self.node.van, worker,
                                                  self.node.host_of(worker), offer)
        except stream.StreamBroken as e:
            self.broken(worker, e)

    def send(self, worker, kind, header, arrays):
        """Send on the worker's stream: ``sent()``, true once the arrays have left; None
        if it has none (or it broke): then the van carries the answer."""
        if worker not in self.streams:
            return None
        try:
            return self.streams[worker].send(kind, header, arrays)
        except stream.StreamBroken as e:           # (the worker is gone, most likely)
            self.broken(worker, e)
            return None

    def broken(self, worker, error):
        """The stream to a worker could not open, or broke: say so; the van carries on."""
        self.streams.pop(worker, None)
        lines.say(f'{lines.shown(self.node.id)}: {error}; its answers go through the van')

    def forget(self, worker):
        """A worker starts anew: its stream goes."""
        self.streams.pop(worker, None)
