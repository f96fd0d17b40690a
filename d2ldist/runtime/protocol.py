"""The kinds of control messages between nodes and the scheduler.

Applications (the parameter server, the ring) define their own kinds next to their
code; these are the ones every node speaks.
"""
REGISTER = 'register'          # node -> scheduler: {role, rank, address}
ADDRESS_BOOK = 'address_book'  # scheduler -> node: {nodes: {id: address}, you: id}
ERROR = 'error'                # scheduler -> node: {error}: registration refused
BARRIER = 'barrier'            # node -> scheduler: {group, n}
BARRIER_DONE = 'barrier_done'  # scheduler -> node: {group, n}
HEARTBEAT = 'heartbeat'        # node -> scheduler, every second
GOODBYE = 'goodbye'            # node -> scheduler: finished normally
FAREWELL = 'farewell'          # scheduler -> node: your goodbye arrived (you may exit)
FAILED = 'failed'              # node -> scheduler: {reason}; scheduler -> node: {node, reason}
SHUTDOWN = 'shutdown'          # scheduler -> server: the workers are done
