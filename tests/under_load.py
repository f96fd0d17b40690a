"""Run a command on a busy machine: N processes spin beside it, as a neighbour's job would.

    python tests/under_load.py -- python -m pytest tests/jobs     # two busy processes
    python tests/under_load.py --busy 4 -- make test-fast

A check on a time, a rate or a fitted constant must hold on a shared machine too, not only
on a quiet one (`make test-load` runs the job tests and the chapters this way). Each busy
process is a plain Python loop at the same priority as the tests. It watches its parent
and ends by itself when the parent is gone, so nothing is left spinning even if this
runner is killed; normally the runner stops them when the command ends. The command's
exit code is this script's.
"""
import argparse
import signal
import subprocess
import sys

SPIN = '''
import os
parent = os.getppid()
while os.getppid() == parent:      # end with the runner, whatever ends it
    for _ in range(1_000_000):
        pass
'''


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--busy', type=int, default=2, help='busy processes (default 2)')
    parser.add_argument('command', nargs=argparse.REMAINDER, help='what to run, after --')
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    if not command:
        parser.error('no command given (write it after --)')
    spinners = [subprocess.Popen([sys.executable, '-c', SPIN]) for _ in range(args.busy)]
    print(f'under_load: {args.busy} busy processes beside: {" ".join(command)}', flush=True)
    try:
        return subprocess.call(command)
    except KeyboardInterrupt:
        return 130
    finally:
        for p in spinners:
            p.send_signal(signal.SIGKILL)
            p.wait()


if __name__ == '__main__':
    sys.exit(main())
