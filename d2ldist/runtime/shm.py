"""Shared memory for big frames between processes on the same host (after NCCL's and
MPI's intra-node transports).

For a frame of at least ``SHM_MIN_BYTES`` sent to a peer on the same host, the van copies
the frame into a *block* of this process's shared memory (``Pool``), sends where it lies
inside the authenticated header (``[frame index, pid, fd, offset, nbytes]``), and the
receiver maps ``/proc/<pid>/fd/<fd>`` and hands the application a memoryview of the
block (``Mapper``): one copy instead of the kernel's two.

A block is a memfd, gone with the last process that holds it. Its state word says who
may reuse it, without any message:

    FREE --sender copies a frame in--> SENT --receiver maps it--> MAPPED
      ^                                                             |
      +--- the last user of the receiver's view is gone (finalizer) -+

Used only on x86-64 Linux (the memory ordering relies on TSO); ``D2L_SHM=0`` turns it off.
Why it is safe, and what "same host" means: docs/design/runtime.md, "Shared memory".
"""
import ctypes
import mmap
import os
import platform
import stat
import sys
import weakref
from collections import OrderedDict

from .. import config
from ..lines import clip

# Smaller frames go through the socket. benchmarks/transport.py, two processes on 2 busy
# cores, CPU per byte of socket / shared memory: 256 KB about even (per-message costs
# dominate), 1 MB 1.2-1.4x, 4 MB 2.2-3x, 16 MB 2.5x, 64 MB 4.7-5.6x (page faults).
SHM_MIN_BYTES = 256 * 1024
SHM_POOL_BYTES = 4 << 30        # one process's blocks at most (pages are used lazily)
MAX_MAPPED_BYTES = 16 << 30     # other processes' blocks a receiver keeps mapped
HEADER_BYTES = 64               # magic, state word; the data start here
MAGIC = b'd2lshm01'
NAME = 'd2ldist-shm'            # what /proc/<pid>/fd/<fd> points to: /memfd:d2ldist-shm
FREE, SENT, MAPPED = 0, 1, 2


def enabled(cfg=None):
    """Whether a process with these settings (default: this one's) may move frames
    through shared memory (D2L_SHM, and the platform)."""
    return ((config.get() if cfg is None else cfg).shm and sys.platform == 'linux'
            and platform.machine() in ('x86_64', 'AMD64') and hasattr(os, 'memfd_create'))


class Block:
    """One memfd: a 64-byte header (magic, state word) and room for one frame."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER_BYTES + capacity)     # pages come when first touched
        self.map = mmap.mmap(self.fd, HEADER_BYTES + capacity)
        self.map[:len(MAGIC)] = MAGIC
        self.state = ctypes.c_int64.from_buffer(self.map, 8)


class Pool:
    """The sender's blocks, by capacity (powers of two); FREE ones are reused."""

    def __init__(self, limit=SHM_POOL_BYTES):
        self.limit, self.bytes = limit, 0
        self.blocks = {}                        # capacity -> [Block]
        self.sent = self.created = self.fallbacks = 0

    def share(self, frames):
        """Put the big frames in shared memory: (the frames to send, where they lie:
        ``[[frame index, pid, fd, offset, nbytes], ...]``); a shared one goes empty."""
        out, where = [], []
        for i, f in enumerate(frames):
            desc = self.put(f) if f.nbytes >= SHM_MIN_BYTES else None
            if desc is not None:
                where.append([i] + desc)
            out.append(f if desc is None else memoryview(b''))
        return out, where

    def put(self, frame):
        """Copy a frame into a FREE block: its descriptor [pid, fd, offset, nbytes], or None
        if the pool is full (send it through the socket then)."""
        n = frame.nbytes
        capacity = 1 << max(n - 1, 1).bit_length()
        block = next((b for b in self.blocks.get(capacity, ()) if b.state.value == FREE), None)
        if block is None:
            if self.bytes + capacity > self.limit and not self._evict(capacity):
                self.fallbacks += 1
                return None
            block = Block(capacity)
            self.blocks.setdefault(capacity, []).append(block)
            self.bytes += capacity
            self.created += 1
        block.state.value = SENT
        block.map[HEADER_BYTES:HEADER_BYTES + n] = frame    # the one copy
        self.sent += 1
        return [os.getpid(), block.fd, HEADER_BYTES, n]

    def _evict(self, capacity):
        """Close FREE blocks of other sizes until ``capacity`` fits; False if it cannot."""
        for size, blocks in self.blocks.items():
            for b in [b for b in blocks if b.state.value == FREE and size != capacity]:
                blocks.remove(b)
                os.close(b.fd)                  # the memory goes with the last mapping
                self.bytes -= size
                if self.bytes + capacity <= self.limit:
                    return True
        return False

    def unmapped(self):
        """How many blocks were sent but not yet mapped by their receiver."""
        return sum(b.state.value == SENT for blocks in self.blocks.values() for b in blocks)

    def stats(self):
        return {'blocks': sum(map(len, self.blocks.values())), 'bytes': self.bytes,
                'sent': self.sent, 'created': self.created, 'fallbacks': self.fallbacks}

    def close(self):
        for blocks in self.blocks.values():
            for b in blocks:
                os.close(b.fd)
        self.blocks.clear()


class Mapper:
    """The receiver's side: other processes' blocks, mapped once, lent out as views."""

    def __init__(self, limit=MAX_MAPPED_BYTES):
        self.maps = OrderedDict()               # (pid, fd) -> (file identity, mmap)
        self.limit, self.bytes, self.received = limit, 0, 0

    def frames(self, where, data):
        """The frames received, with those ``where`` names in shared memory mapped in;
        ValueError if a check fails."""
        if not isinstance(where, list) or len(where) > len(data):
            raise ValueError('malformed list')
        data, seen = list(data), set()
        for entry in where:       # [frame index, pid, fd, offset, nbytes]
            if not (isinstance(entry, list) and len(entry) == 5
                    and all(type(x) is int for x in entry)):
                raise ValueError(clip(f'malformed entry {entry!r}', 120))
            i, pid, fd = entry[:3]
            if not (0 <= i < len(data) and data[i].nbytes == 0) or {i, (pid, fd)} & seen:
                raise ValueError(clip(f'entry {entry!r} does not fit the frames', 120))
            seen.update([i, (pid, fd)])
            data[i] = self.view(entry[1:])
        return data

    def view(self, desc):
        """A writable memoryview of the block ``desc`` = [pid, fd, offset, nbytes] names;
        ValueError if it names no block of ours that is SENT, or reaches past its end."""
        if not (isinstance(desc, list) and len(desc) == 4
                and all(type(x) is int and 0 <= x < 2**62 for x in desc)):
            raise ValueError(clip(f'malformed descriptor {desc!r}', 120))
        pid, fd, offset, nbytes = desc
        mm = self._map(pid, fd)
        if offset < HEADER_BYTES or nbytes < 1 or offset + nbytes > len(mm):
            raise ValueError(f'{nbytes} bytes at {offset} are outside the block of {len(mm)}')
        state = ctypes.c_int64.from_buffer(mm, 8)
        if state.value != SENT:
            raise ValueError('the block was not sent (or is already in use)')
        state.value = MAPPED
        data = (ctypes.c_ubyte * nbytes).from_buffer(mm, offset)
        weakref.finalize(data, _free, state)    # its last user gone: the sender may reuse it
        self.received += 1
        return memoryview(data).cast('B')

    def _map(self, pid, fd):
        """The mapping of /proc/pid/fd/fd, checked to be a d2ldist memfd (cached)."""
        path = f'/proc/{pid}/fd/{fd}'
        try:
            st = os.stat(path)
            identity, entry = (st.st_dev, st.st_ino), self.maps.get((pid, fd))
            if entry is not None and entry[0] == identity:
                self.maps.move_to_end((pid, fd))
                return entry[1]
            if not os.readlink(path).startswith('/memfd:' + NAME):
                raise ValueError(f'{path} is not a d2ldist block')
            f = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)   # never blocks
            try:
                st = os.fstat(f)                        # what we opened is what we checked
                if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != identity:
                    raise ValueError(f'{path} changed while we opened it')
                mm = mmap.mmap(f, 0)
            finally:
                os.close(f)
        except OSError as e:
            raise ValueError(f'cannot map {path}: {e.strerror} (processes in other pid '
                             f'namespaces? D2L_SHM=0 sends through the socket)') from None
        if len(mm) <= HEADER_BYTES or mm[:len(MAGIC)] != MAGIC:
            raise ValueError(f'{path} is not a d2ldist block')
        if entry is not None:
            self.bytes -= len(entry[1])
        self.maps[(pid, fd)] = (identity, mm)
        self.bytes += len(mm)
        while self.bytes > self.limit and len(self.maps) > 1:   # views keep theirs alive
            _, (_, old) = self.maps.popitem(last=False)
            self.bytes -= len(old)
        return mm


def _free(state):
    state.value = FREE


def same_host(address, peer_address):
    """Whether two tcp://host:port addresses are on one host: same host, or both loopback."""
    a, b = (x.split('://')[-1].rsplit(':', 1)[0].strip('[]') for x in (address, peer_address))
    return a == b or (_loopback(a) and _loopback(b))


def identity():
    """Who can open whose blocks: this boot of the kernel, our pid namespace, our user.

    Two containers with the host's network share an address but not their processes
    (``/proc/<pid>`` of one is not the other's): their identities differ, so they keep
    to the socket. None where it cannot be told (then shared memory is not used).
    """
    try:
        with open('/proc/sys/kernel/random/boot_id') as f:
            boot = f.read().strip()
        return f'{boot}/{os.stat("/proc/self/ns/pid").st_ino}/{os.getuid()}'
    except OSError:
        return None


def _loopback(host):
    return host.startswith('127.') or host in ('localhost', '::1')
