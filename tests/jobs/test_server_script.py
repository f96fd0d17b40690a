"""D2L_SERVER_SCRIPT: a job whose servers run the user's own script (a PS from scratch)."""
from support import run_launch, wait_no_survivors

SCRIPT = '''\
import os
from d2ldist import Node
role = os.environ['D2L_ROLE']
node = Node.from_env(role).start()
if role == 'server':
    msg = node.recv(['ping'], timeout=30)          # one ping from each worker
    msg2 = node.recv(['ping'], timeout=30)
    for m in (msg, msg2):
        node.send(m.sender, 'pong', {'n': m['n'] * 10 + node.rank})
    print(f'server {node.rank} answered', flush=True)
else:
    for s in node.peers('server'):
        node.send(s, 'ping', {'n': node.rank + 1})
    got = sorted(node.recv(['pong'], timeout=30)['n'] for _ in node.peers('server'))
    print(f'worker {node.rank} got {got}', flush=True)
node.barrier('all')
node.stop()
'''


def test_servers_run_the_users_script(write_script):
    path = write_script(SCRIPT, name='my_ps.py')
    r = run_launch('-n', '2', '-s', '2', '--env', f'D2L_SERVER_SCRIPT={path}', path,
                   timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '[worker 0] worker 0 got [10, 11]' in r.stdout
    assert '[worker 1] worker 1 got [20, 21]' in r.stdout
    assert '[server 0] server 0 answered' in r.stdout
    assert '[server 1] server 1 answered' in r.stdout
    wait_no_survivors(r.tag)


def test_missing_server_script_fails_in_one_line(write_script):
    path = write_script('print("hi")\n', name='w.py')
    r = run_launch('-n', '1', '-s', '1', '--env', 'D2L_SERVER_SCRIPT=/no/such.py', path,
                   timeout=60)
    assert r.returncode != 0
    assert 'D2L_SERVER_SCRIPT: no such file: /no/such.py' in r.stdout + r.stderr
    wait_no_survivors(r.tag)
