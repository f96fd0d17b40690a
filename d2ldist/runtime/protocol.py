"""The kinds of control messages between nodes and the scheduler.

Applications (the parameter server, the ring) define their own kinds next to their
code; these are the ones every node speaks.
"""
REGISTER = 'register'          # node -> scheduler: {role, rank, address}
ADDRESS_BOOK = 'address_book'  # scheduler -> node: {nodes: {id: address}, you: id}
ERROR = 'error'                # scheduler -> node: {error}: registration refused
BARRIER = 'barrier'            # node -> scheduler: {group, n, what, round}
BARRIER_DONE = 'barrier_done'  # scheduler -> node: {group, n, round}
HEARTBEAT = 'heartbeat'        # node -> scheduler, every second: {what, for, counters}
GOODBYE = 'goodbye'            # node -> scheduler: {counters}: finished normally
FAREWELL = 'farewell'          # scheduler -> node: your goodbye arrived (you may exit)
FAILED = 'failed'              # node -> scheduler: {reason}; scheduler -> node: {node, reason}
SHUTDOWN = 'shutdown'          # scheduler -> server: the workers are done
WHO = 'who'                    # node -> scheduler or server: {id, question}: who is missing?
WHO_ANSWER = 'who_answer'      # the answer: {id, missing: [[node, what it is doing]]}
BARRIER_DISAGREE = 'barrier_disagree'  # scheduler -> nodes: {error}: two different barriers
CLOCK = 'clock'                # node -> scheduler: {id}; the answer: {id, time} (spans.py)
JOIN = 'join'                  # worker -> scheduler: {calls}: it called hvd.join() (out of data)
JOIN_NOTED = 'join_noted'      # scheduler -> worker: its join is counted (now tell the others)
JOIN_DONE = 'join_done'        # scheduler -> workers: {last, calls} (all have joined) or {error}
MEMBERS = 'members'            # scheduler -> workers: {round, workers, lost, joined, reason, joins}
JOINING = 'joining'            # scheduler -> workers: {joins}: a worker waits to join (the ring)
READY = 'ready'                # worker -> scheduler: {round}: at a commit, ready to take it in
WORKERS = 'workers'            # scheduler -> servers: {workers, round}: whom sync rounds wait for
ENDED = 'ended'                # launcher -> scheduler: {node, start, how}: its process ended (elastic)
SERVERS = 'servers'            # scheduler -> nodes: {chains, lost, reason}: who holds each shard (replicas)
HOLDS = 'holds'                # server -> scheduler: {shard}: its copy came (a new holder)
