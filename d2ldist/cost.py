"""What one synchronous step of communication costs: the book's one cost model.

The notation is that of chapter 1's Notation section: ``M`` bytes of gradients, ``m``
workers, ``n`` servers, ``N`` processes in a ring, ``B`` the bandwidth of each process's
outgoing link in bytes per second, ``alpha`` the latency of one message in seconds.
Links are full duplex and only their outgoing side is a limit (as on a switched
network, and as ``--bandwidth`` paces them): a process sends at most B bytes a second
and may receive from several at once. Each message pays ``alpha`` once.

* Parameter server (push, then pull): every worker sends its M bytes, server by server,
  in M/B; server j holds L_j bytes and then answers m workers, m L_j / B. The step ends
  when the slowest server has answered:
      T = max_j (L_0 + ... + L_j + m L_j) / B + 2 alpha  =  (1 + m/n) M/B + 2 alpha  (even)
* Ring all-reduce of N processes: 2(N-1) steps (reduce-scatter, then all-gather), each
  sending M/N bytes to the next process:
      T = 2(N-1) (M/(N B) + alpha)
* Hierarchical all-reduce of h machines with g GPUs each: reduce onto one GPU inside
  every machine and, after the ring of the h machines, broadcast from it; each of the
  two, pipelined in chunks, sends every link inside the M bytes once and crosses g-1
  links (B_in, alpha_in):
      T = 2 (M/B_in + (g-1) alpha_in) + 2(h-1) (M/(h B_across) + alpha)

``benchmarks/scaling.py`` and the scaling chapter set measured times against these;
``tests/jobs/test_scaling.py`` and ``tests/system/test_shaping.py`` check they agree.
"""
import math

from .kv.placement import place

numel = math.prod        # the number of elements of a tensor of this shape


def ps_time(M, m, n, B, alpha=0.0):
    """Seconds of one push and pull when n servers share the M bytes evenly."""
    return (1 + m / n) * M / B + 2 * alpha


def ring_time(M, N, B, alpha=0.0):
    """Seconds of one ring all-reduce of M bytes over N processes."""
    return 2 * (N - 1) * (M / N / B + alpha)


def hierarchical_time(M, machines, per_machine, B_inside, B_across, alpha=0.0,
                      alpha_inside=0.0):
    """Seconds of a reduce inside each machine, a ring across them, a broadcast inside."""
    inside = 2 * (M / B_inside + (per_machine - 1) * alpha_inside) if per_machine > 1 else 0.0
    return inside + ring_time(M, machines, B_across, alpha)


def server_loads(shapes, n, bound=None, itemsize=4):
    """Bytes each of n servers holds for tensors of these shapes, by the real placement."""
    loads = [0] * n
    for key, shape in enumerate(shapes):
        for server, start, stop in place(key, numel(shape), n, bound):
            loads[server] += itemsize * (stop - start)
    return loads


def ps_time_placed(shapes, m, n, B, alpha=0.0, bound=None):
    """Seconds of one push and pull with the real placement: small tensors whole on one
    server, tensors of ``bound`` elements or more split over all (the servers' shares
    are then uneven, and the busiest server sets the time)."""
    sent, worst = 0, 0.0
    for load in server_loads(shapes, n, bound):
        if load:
            sent += load                     # a worker pushes to the servers in turn
            worst = max(worst, (sent + m * load) / B)
    return worst + 2 * alpha
