"""The reading path: the lines a student reads to follow one all-reduce and one push/pull.

Each path lists, in the order a call reaches them, the functions on its plain way through
the layers: from the Trainer's step down to the van and back. The script prints each
one's place and length and each path's total; ARCHITECTURE.md's "Read this first" is its
output, and tests/unit/test_reading_path.py keeps both true (the names exist, the page
shows what the script prints, the totals stay within the bounds below).

    python book/reading_path.py            # print it
    python book/reading_path.py --write    # and write it into ARCHITECTURE.md
"""
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# the bounds issue 49 set: one all-reduce, one push/pull
BOUNDS = {'one ring all-reduce': 450, 'one push/pull': 550}

# what both paths read: one message sent and received (runtime/)
MESSAGE = [
    ('d2ldist/runtime/node.py', ['Node.send', 'Node.recv', 'Node._recv']),
    ('d2ldist/runtime/van.py', ['Van.send', 'Van._put', 'Van._mac', 'mac_of', 'encoded',
                                'Van.recv', 'Van._next', 'Van._from_router', 'Van._check']),
]

PATHS = {
    'one ring all-reduce': [
        ('d2ldist/training/trainer.py', ['Trainer.step', 'Trainer._gradient_ready',
                                         'Trainer._sum_replicas', 'Trainer._start_bucket',
                                         'Trainer._span', 'Trainer._push',
                                         'Trainer._bucket_summed', 'Trainer._update']),
        ('d2ldist/collectives/buckets.py', ['BackwardBuckets._produced', 'Buckets.ready',
                                            'Buckets.wait']),
        ('d2ldist/training/stores.py', ['AllreduceStore.allreduce_async_']),
        ('d2ldist/collectives/world.py', ['run']),
        ('d2ldist/collectives/engine.py', ['Engine.run', 'Engine._loop', 'Handle.wait']),
        ('d2ldist/collectives/compressed.py', ['allreduce_']),
        ('d2ldist/collectives/ring_backend.py', ['RingBackend.allreduce_']),
        ('d2ldist/collectives/ring.py', ['Ring.allreduce_', 'Ring._begin', 'Ring.chunks',
                                         'Ring._relay']),
        ('d2ldist/collectives/link.py', ['Link.begin', 'Link.send', 'Link.recv', 'Link._take',
                                         'Link.end']),
        *MESSAGE,
    ],
    'one push/pull': [
        ('d2ldist/training/trainer.py', ['Trainer.step', 'Trainer._sum_replicas',
                                         'Trainer._push', 'Trainer._update']),
        ('d2ldist/kv/worker.py', ['KVStore.push', 'KVStore._reduce', 'KVStore.pull',
                                  'DistKVStore._push', 'DistKVStore._pull',
                                  'DistKVStore._numbered', 'DistKVStore._messages',
                                  'DistKVStore._receiver', 'DistKVStore._ask']),
        ('d2ldist/kv/asking.py', ['InFlight.send', 'InFlight.answers', 'InFlight.answered',
                                  'InFlight._receive', 'InFlight._send']),
        ('d2ldist/kv/messages.py', ['Part.head', 'read_parts']),
        *MESSAGE,
        ('d2ldist/kv/serving.py', ['ServerLoop.serve', 'ServerLoop.dispatch',
                                   'ServerLoop.receive']),
        ('d2ldist/kv/server.py', ['KVServer.handle', 'KVServer.push', 'KVServer.pushed_into',
                                  'Round.add', 'Round._add', 'KVServer.pushed',
                                  'KVServer.close', 'Round.total', 'KVServer.update',
                                  'apply_update', 'KVServer.pull', 'KVServer.open_rounds',
                                  'KVServer.answer_push', 'KVServer.ack',
                                  'KVServer.answer_ready', 'KVServer.send_values']),
    ],
}

# What the plain path calls on its own object (or in its own module) but a first reading
# may skip, and why (tests/unit/test_reading_path.py: every such call is on a path or here).
ASIDE = {
    # runtime: one message
    'Node._watched': 'the hang detector: the same receive, with deadlines that name who is '
                     'missing',
    'Node._stashed': 'a message of these kinds that came earlier, while another kind was '
                     'awaited',
    'Node._news': "the scheduler's news on the way: a failure, a new membership, new chains "
                  'of servers',
    'Van._share': 'shared memory: big frames to a peer on this host go there instead',
    'Van._next_of_all': "the streams' sockets (the ring's TCP links) polled beside the ROUTER",
    'Van.drop': 'the log line of a dropped message, at most one a second',
    'header_of': "the van's header fields and their types (the table HEADER), checked",
    # collectives: one ring all-reduce
    'Link._next': 'the messages not of this call: a newer membership\'s kept until its news, '
                  "a later call's kept, stale ones dropped, join() notices noted (classify)",
    'Link._check': 'is it the chunk expected? Workers that called different collectives all '
                   'stop with one message',
    'Link._fail': 'a call that failed on every worker: raise, and drop its late chunks',
    'Link._check_membership': 'elastic: a collective on the ring of an old membership fails',
    'Link._watched': 'the hang detector: what this wait is, so the scheduler can name who is '
                     'missing',
    'Link.open': 'once a link: the TCP stream to the right neighbour, where chunks would '
                 'cross a socket',
    'Link._check_root': 'join(): a broadcast from a worker out of data fails',
    'Link._put_back': 'messages kept for later (a later call, a newer membership) back to '
                      'the node',
    'Link._stream_news': "elastic: a broken stream waits for the scheduler's word on its "
                         'worker',
    'RingBackend._check': 'a dtype the wire cannot carry: refused on every worker',
    'Buckets.missing': 'unused layers: parameters whose gradient never came, started at wait()',
    'Buckets._reset': "the next step's bookkeeping: no gradient in, no bucket started",
    # training: the step around it (shared with the push/pull path)
    'Trainer.timed': "the step's time waiting for the devices, for the report",
    'Trainer.init': "the first step only: the weights into the store, rank 0's to all",
    'Trainer._copy_to_device': 'step 6: the new weights to the first device (on a CPU: '
                               'nothing)',
    'Trainer._broadcast': 'step 7: the weights to the other devices (one device: nothing)',
    'Trainer._grads_moved': 'sums and weights on different devices (a GPU and the host): '
                            'the sums copied over, the copy waited for',
    # the worker's side of the store (kv/worker.py, kv/asking.py, kv/messages.py)
    'KVStore._check': 'a value that does not fit its key: a clear error, nothing else',
    'KVStore._outputs': 'the outputs as a list, each checked to fit its key (_check)',
    'KVStore._to_cpu': 'a CPU tensor is sent as it is; a CUDA one through a pinned buffer',
    'KVStore._fill': 'an output that is not the CPU tensor read into (CUDA, copies) gets a copy',
    'KVStore._coded': 'which pushes gradient compression codes (none unless it is set)',
    'KVStore._push_sparse': "a sparse gradient's rows (nn.Embedding(sparse=True))",
    'KVStore._rows': "a sparse gradient's rows and their ids, on the CPU",
    'KVStore._sparse_outs': 'a sparse out of a pull: left as it is, or filled densely',
    'KVStore._fill_sparse': 'the rows pulled for a sparse out, copied into it',
    '_read_in_place': 'parts still in a stream (another host) read straight into place',
    'InFlight._hang_wait': 'a long wait asks the servers who is missing (runtime/hang.py)',
    'InFlight._resend': "a server lost: its requests go again to its replica (replicas)",
    'InFlight._read': "a stream's word that an answer's values are in place",
    '_codec': "the codec of compressed parts, checked (gradient compression)",
    '_decoded': 'a compressed part decoded (gradient compression)',
    # the server's side (kv/serving.py, kv/server.py)
    'ServerLoop.other': "the scheduler's news, streams, joiners, hang questions, replicas",
    'ServerLoop.retry': "requests kept waiting behind a worker's early push (none in one)",
    'KVServer.handle_other': 'sparse rows, INFO, GET_STATE and the changes (init, optimizer)',
    'check_held': 'a key never initialised, or of another shape: a clear error',
    'KVServer.push_async': 'dist_async: each push applied at once, no round',
    'KVServer.agree': "workers whose n-th pushes differ in keys fail at once, not hang",
    'KVServer.uncounted': 'a push sent again to a replica made head is counted once',
    'Round._add_rows': "a sparse key's rows added into zeros",
    'apply_rows': "a sparse key's rows updated (the optimizer's lazy update)",
    'KVServer.served': 'counts closed rounds for d2l-launch --fail (fault injection)',
    'KVServer.writable': 'a value still being sent from its own memory is copied first',
    'KVServer.lend': 'remembers the values being sent from their own memory (writable)',
    'KVServer.send_rows': "a sparse key's rows answered",
}


def spans(path):
    """{'Class.method' or 'function': (first line, last line)} of a module's functions."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found[prefix + child.name] = (first, child.end_lineno)
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + '.')

    visit(ast.parse((ROOT / path).read_text()), '')
    return found


def rows(path_steps):
    """[(file, name, first, last)] of one path; a name that is not there is a KeyError."""
    out = []
    for file, names in path_steps:
        where = spans(file)
        for name in names:
            if name not in where:
                raise KeyError(f'{file} has no function {name} (book/reading_path.py)')
            out.append((file, name, *where[name]))
    return out


def table(title, path_steps):
    """The path as the lines of a table, with its total."""
    lines, total = [f'{title}:'], 0
    for file, name, first, last in rows(path_steps):
        n = last - first + 1
        total += n
        lines.append(f'  {file:36} {name:30} {first:4}-{last:<4} {n:3}')
    files = len({file for file, _ in path_steps})
    lines.append(f'  {"total":36} {f"{files} files":30} {"":9} {total:3}'
                 f'   (at most {BOUNDS[title]})')
    return lines, total


def report():
    """The whole printout: every path's table."""
    out = []
    for title, steps in PATHS.items():
        out += table(title, steps)[0] + ['']
    return '\n'.join(out[:-1])


def write(page=ROOT / 'ARCHITECTURE.md'):
    """Put the printout into the page's "Read this first" block."""
    text = page.read_text()
    block = re.compile(r'(^## Read this first\n.*?^```text\n).*?(^```)', re.S | re.M)
    if not block.search(text):
        raise SystemExit(f'{page.name} has no "Read this first" block with a ```text printout')
    page.write_text(block.sub(lambda m: m.group(1) + report() + '\n' + m.group(2), text, 1))


if __name__ == '__main__':
    print(report())
    if sys.argv[1:] == ['--write']:
        write()
