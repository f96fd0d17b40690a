"""A simulated network: each process's outgoing link has a bandwidth and a latency.

    d2l-launch --bandwidth 1Gbit --latency 0.5ms -n 4 -s 4 python train.py

The launcher puts the two numbers in every process's environment (D2L_BANDWIDTH in
bytes/s, D2L_LATENCY in seconds; ``config.py`` reads them, and parses the units of
``--bandwidth`` and ``--latency``) and the van gives each process one ``Pacer``: a
model of its network card. A message of ``b`` bytes sent at time ``t`` is
transmitted when the link is free, takes ``b / rate`` seconds, and is delivered
``latency`` later:

    start = max(t, free_at);  free_at = start + b / rate;  due = free_at + latency

The sender stamps ``due`` into the message; the receiving van holds the message
until then (on one machine every process reads the same clock). The sender itself
waits only as a token bucket makes it wait: while more than ``burst`` bytes are
still queued on its link. So latency never serializes a pipeline -- ten messages
in flight take ten transmission times plus ONE latency, as on a real wire.
"""
import heapq
import itertools
import math
import time

HEADER_ON_WIRE = 256     # bytes a message's header counts on a simulated link


def describe(rate=None, latency=0.0):
    """'1 Gbit/s (125 MB/s), 0.5 ms': how a link is printed."""
    words = []
    if rate:
        words.append(f'{rate * 8 / 1e6:g} Mbit/s ({rate / 1e6:g} MB/s)')
    if latency:
        words.append(f'{latency * 1e3:g} ms latency')
    return ', '.join(words) or 'unshaped'


class Pacer:
    """One process's outgoing link: when each message it sends may be delivered."""

    def __init__(self, rate=None, latency=0.0, burst=None):
        self.rate, self.latency = rate, latency          # bytes/s (None: unlimited), s
        # the token bucket's depth (a socket buffer): 50 ms of traffic, so that a sender
        # woken late on a busy machine still finds bytes queued and the link never idles
        self.burst = burst if burst is not None else max(256 * 1024, (rate or 0) * 0.05)
        self.free_at = 0.0                               # when the link is idle again

    def book(self, nbytes, now=None):
        """Put ``nbytes`` on the link at ``now`` (the clock's time unless given):
        (delivery time, seconds the sender must wait)."""
        now = time.time() if now is None else now
        if self.rate is None:
            return now + self.latency, 0.0
        self.free_at = max(now, self.free_at) + nbytes / self.rate
        backlog = (self.free_at - now) * self.rate       # bytes still queued
        return self.free_at + self.latency, max(0.0, (backlog - self.burst) / self.rate)

    def stamp(self, head):
        """Book a message on the link now and stamp its header (``sent``, ``delay``):
        the seconds the sender must wait."""
        sent = time.time()
        due, wait = self.book(sum(head['sizes']) + HEADER_ON_WIRE, sent)
        head.update(sent=sent, delay=due - sent)
        return wait


class Held:
    """The receiver's side: messages held until they would have arrived over the link.

    Once one is held, every message queues behind (a message without a delay is due
    at once), so that none overtakes another that is due earlier."""

    def __init__(self):
        self._heap, self._arrivals = [], itertools.count()

    def __bool__(self):
        return bool(self._heap)

    def hold(self, msg):
        heapq.heappush(self._heap, (due(msg), next(self._arrivals), msg))

    def first(self, left):
        """(the first message if it is due now, else None; how long a receiver may wait
        for the socket meanwhile: at most ``left`` seconds, None for no limit)."""
        while True:
            hold = self._heap[0][0] - time.time()
            if hold <= 0:
                return heapq.heappop(self._heap)[2], left
            if not (hold < 0.001 and (left is None or hold <= left)):
                return None, hold if left is None else min(left, hold)
            time.sleep(hold)            # (a socket's poll counts whole milliseconds)
            left = None if left is None else max(0.0, left - hold)


def due(msg):
    """When a message sent over a simulated link arrives (now, if it was not).

    ``sent + delay`` in the sender's clock; at most ``delay`` from now, so that a
    sender whose clock runs ahead of ours cannot make us hold a message longer."""
    sent, delay = msg.get('sent'), msg.get('delay')
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (sent, delay)):
        return 0.0
    now = time.time()
    return min(sent + delay, now + delay)


def pacer_of(cfg):
    """The Pacer that a Config's bandwidth and latency ask for, or None (no simulated link)."""
    if cfg.bandwidth is None and not cfg.latency:
        return None
    return Pacer(cfg.bandwidth, cfg.latency)
