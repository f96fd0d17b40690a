"""A simulated network: each process's outgoing link has a bandwidth and a latency.

    d2l-launch --bandwidth 1Gbit --latency 0.5ms -n 4 -s 4 python train.py

The launcher puts the two numbers in every process's environment (D2L_BANDWIDTH in
bytes/s, D2L_LATENCY in seconds) and the van gives each process one ``Pacer``: a
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
import math
import os
import re
import time

_PREFIX = {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9, 't': 1e12,
           'ki': 2**10, 'mi': 2**20, 'gi': 2**30, 'ti': 2**40}
_RATE = re.compile(r'(?P<num>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*'
                   r'(?P<prefix>[kKmMgGtT]i?|)'
                   r'(?P<unit>bits?|bps|b|bytes?|Bps|B)(?P<per>/s|ps)?')
_BITS = ('bit', 'bits', 'bps', 'b')
_TIME = re.compile(r'(?P<num>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*(?P<unit>s|ms|us|µs|ns)')
_SECONDS = {'s': 1.0, 'ms': 1e-3, 'us': 1e-6, 'µs': 1e-6, 'ns': 1e-9}


def parse_bandwidth(text):
    """Bytes per second from '1Gbit', '100Mbit/s', '250Mbps', '100MB/s', '1.5GiB/s'."""
    m = _RATE.fullmatch(str(text).strip())
    if m is None or (m['unit'] in ('bps', 'Bps') and m['per']):
        raise ValueError(f'bandwidth {text!r}: give a number and a unit, e.g. 1Gbit, '
                         '100Mbit/s, 250Mbps (bits) or 100MB/s, 12.5MiB/s (bytes)')
    rate = float(m['num']) * _PREFIX[m['prefix'].lower()]
    rate = rate / 8 if m['unit'] in _BITS else rate
    if not 0 < rate < math.inf:
        raise ValueError(f'bandwidth {text!r}: must be more than 0')
    return rate


def parse_latency(text):
    """Seconds from '0.5ms', '200us', '1s' (or '0')."""
    text = str(text).strip()
    if text in ('0', '0.0'):
        return 0.0
    m = _TIME.fullmatch(text)
    if m is None:
        raise ValueError(f'latency {text!r}: give a number and a unit: s, ms or us '
                         '(e.g. 0.5ms)')
    return float(m['num']) * _SECONDS[m['unit']]


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


def pacer_from_env(env=os.environ):
    """The Pacer that D2L_BANDWIDTH / D2L_LATENCY ask for, or None (no shaping)."""
    rate, latency = env.get('D2L_BANDWIDTH'), env.get('D2L_LATENCY')
    if not rate and not latency:
        return None
    rate = _number_or(parse_bandwidth, rate) if rate else None
    latency = _number_or(parse_latency, latency) if latency else 0.0
    return Pacer(rate, latency) if rate or latency else None


def _number_or(parse, text):
    """A plain number as the launcher writes it (bytes/s, seconds), else with units."""
    try:
        value = float(text)
    except ValueError:
        return parse(text)
    if not 0 <= value < math.inf:
        raise ValueError(f'{text!r} is not a bandwidth or latency')
    return value
