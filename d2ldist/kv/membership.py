"""Whom a shard's sync rounds wait for: every worker of the job, until the scheduler
says otherwise (elastic workers, ``d2l-launch --min-workers``).

``Members`` answers the server's three questions -- may this push count now, whom
does this round wait for, do the workers' n-th pushes agree -- and takes the
scheduler's news of the workers left. Without elastic workers its answers are
the textbook's: every push counts, every round waits for all N workers. Why a
joiner counts from the round it does: docs/design/kv.md.
"""
from .. import lines


class Members:
    """The workers one shard's rounds wait for, and those that joined the running job."""

    def __init__(self, workers):
        self.workers = set(workers)    # whom a sync round waits for
        self.number = 0                # the scheduler's number of that membership
        self.joining = {}              # worker that joined -> (membership it joined in, keys)
        self.numbered = set(self.workers)   # whose push numbers agree() compares
        self.nth = {}                  # n -> (first worker, its keys, workers seen): push n

    def follower(self):
        """The same workers, as a new replica of another shard sees them: the joiners'
        memberships, not what they pushed here (re-replication, ``copies.py``)."""
        follower = Members(self.workers)
        follower.number, follower.numbered = self.number, set(self.numbered)
        follower.joining = {w: (since, set()) for w, (since, _) in self.joining.items()}
        return follower

    @staticmethod
    def knew(msg):
        """The membership a push's sender knew as it pushed."""
        return msg.get('membership') if isinstance(msg.get('membership'), int) else 0

    def waits_for(self, key, r):
        """The workers the round ``r`` of ``key`` waits for: the workers left, a worker
        that joined only once it entered the key's rounds or a push knew of it."""
        return {w for w in self.workers if w not in self.joining or key in self.joining[w][1]
                or r.membership >= self.joining[w][0]}

    def may_count(self, msg, parts, rounds):
        """May this sync push count now? Not if it knew a newer membership than this
        server (the scheduler's word is on its way); from a worker that joined, only
        into rounds that wait for it (or with no one else left to decide)."""
        worker = msg.sender
        if self.knew(msg) > self.number:
            return False
        if worker not in self.joining or not self.workers - set(self.joining):
            return True
        since, entered = self.joining[worker]
        return all(p.key in entered or getattr(rounds.get(p.key), 'membership', 0) >= since
                   for p in parts)

    def entered(self, msg, key, r):
        """A push of ``msg`` is in the round ``r`` of ``key``: the round knows what it knew."""
        r.membership = max(r.membership, self.knew(msg))
        if msg.sender in self.joining:
            self.joining[msg.sender][1].add(key)

    def changed(self, workers, number):
        """The scheduler's news: the workers left are ``workers`` (membership ``number``);
        a worker new here joined. False if the news is malformed."""
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers) \
                or not isinstance(number, int):
            return False
        self.joining = {w: j for w, j in self.joining.items() if w in workers}
        self.joining.update({w: (number, set()) for w in set(workers) - self.workers})
        self.number = max(self.number, number)
        self.workers, self.numbered = set(workers), self.numbered & set(workers)
        self.nth = {n: entry for n, entry in self.nth.items() if not entry[2] >= self.numbered}
        return True

    def disagree(self, worker, n, keys):
        """Sync pushes are numbered per worker and server: every worker's n-th push here
        must carry the same keys. The error naming both sides if not, else None."""
        if not isinstance(n, int) or worker not in self.numbered:   # (one that joined)
            return None
        first, firsts_keys, seen = self.nth.setdefault(n, (worker, keys, set()))
        seen.add(worker)
        if keys != firsts_keys:
            (a, keys_a), (b, keys_b) = sorted([(first, firsts_keys), (worker, keys)],
                                              key=lambda p: int(p[0].split(':')[1]))
            return lines.clip(f'push {n} of {lines.shown(a)} carried keys {keys_a!r}, push {n} '
                              f'of {lines.shown(b)} keys {keys_b!r}; in dist_sync every worker '
                              'must push the same keys in the same order')
        if seen >= self.numbered:
            del self.nth[n]
        return None
