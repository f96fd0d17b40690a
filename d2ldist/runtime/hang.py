"""The hang detector: a node that waits too long says for what, and who is missing.

Every wait of a node for others goes through ``Node.recv(..., wait=Wait(...))``. After
``D2L_HANG_WARN`` seconds (``d2l-launch --hang-warn``) the node asks whoever knows (the
scheduler, a server) who has not arrived, and prints one line::

    d2ldist: worker 0 has waited 30 s in all-reduce call 12 (Sum, float32, [1000]):
    worker 2 has not arrived (it is at call 11, computing or in its own code)

After ``D2L_HANG_FAIL`` seconds (``--hang-fail``) it raises ``Hang`` with that line;
if all it waits for have ended, ``Ended`` at once. Where nodes meet, a call that
differs from the other side's raises ``Disagree``. The reasoning:
docs/design/runtime.md, "The hang detector".
"""
from dataclasses import dataclass, field

from ..lines import shown

LOOK = 1.0      # seconds of waiting after which a node asks whether those it waits for ended


class Hang(RuntimeError):
    """A node waited longer than D2L_HANG_FAIL seconds (the message says for whom)."""


class Ended(Hang):
    """A node waits for others that have ended (their scripts returned) without coming."""


class Disagree(RuntimeError):
    """Nodes that must call the same thing called different things (a collective of
    another shape, a barrier from another call, other keys pushed): the message names
    both sides. It stops every node of the job at once, instead of a hang."""


@dataclass
class Wait:
    """What a node waits for, and whom to ask who has not arrived.

    ``questions``: (peer, question) pairs; a question is {'barrier': [group, n]},
    {'counter': name, 'n': n} (nodes that have started fewer than n), {'request': id}
    (a server: who has not pushed into the rounds this request waits for)."""
    what: str
    questions: list = field(default_factory=list)
    span: str = 'wait'        # the name of the wait on the timeline


def parse_seconds(text, option):
    """A threshold given to the launcher: a positive number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1
    if not seconds > 0:
        raise ValueError(f'{option} takes a positive number of seconds, got {text!r}')
    return seconds


def describe(node, doing):
    """'it is waiting in worker barrier 3 (kv.init) for 12 s': what the scheduler (and a
    server, its ``note``) know of a node that has not arrived."""
    doing = doing if isinstance(doing, dict) else {}
    said = [str(doing['note'])] if doing.get('note') else []
    if 'counter' in doing:
        said.append(f"it has started {doing['counter']} collectives")
    if doing.get('state'):
        said.append(f"it has {doing['state']}")
    elif doing.get('what'):
        said.append(f"it is waiting {doing['what']} for {doing.get('for') or 0:.0f} s")
    else:
        said.append('it is computing, or in its own code')
    return '; '.join(said)


def sentence(missing):
    """The answer of whoever knows, as the end of the hang line."""
    if not missing:
        return 'every node it waits for has arrived; the message it needs has not come'
    named = [f"{shown(node)} ({describe(node, doing)})" for node, doing in missing]
    if len(named) == 1:
        return named[0].replace(' (', ' has not arrived (', 1)
    return '; '.join(named) + ' have not arrived'
