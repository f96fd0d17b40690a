"""The one list of D2L_* variables (d2ldist/config.py): read, typed, refused, written,
and ARCHITECTURE.md's table of them."""
import re
from dataclasses import fields

import pytest

from support import ROOT
from d2ldist import config
from d2ldist.config import Config


def test_outside_a_job_every_setting_is_its_default():
    cfg = Config.from_env({'PATH': '/bin', 'D2L_TEST_TAG': 'x'})   # others: not ours
    assert cfg == Config() and not cfg.in_job
    assert (cfg.role, cfg.rank, cfg.hang_warn, cfg.hang_fail, cfg.shm, cfg.timeline) == \
        (None, None, 30.0, None, True, False)


def test_variables_are_read_as_numbers_flags_and_units():
    cfg = Config.from_env({
        'D2L_ROLE': 'worker', 'D2L_RANK': '3', 'D2L_SCHEDULER_URI': '10.0.0.1',
        'D2L_HEARTBEAT_TIMEOUT': '2.5', 'D2L_MAC_PAYLOAD': '1', 'D2L_SHM': '0',
        'D2L_BANDWIDTH': '1Gbit', 'D2L_LATENCY': '0.001', 'D2L_SLOW': '+200ms',
        'D2L_FAIL': 'step=40', 'D2L_HANG_WARN': '0', 'D2L_HANG_FAIL': '5.5',
        'D2L_TIMELINE': '1', 'D2L_TIMELINE_STEPS': '7', 'D2L_RING_CHUNK': '',
        'D2L_ZMQ_IO_THREADS': '1'})
    assert cfg.in_job and (cfg.role, cfg.rank, cfg.heartbeat_timeout) == ('worker', 3, 2.5)
    assert (cfg.mac_payload, cfg.shm, cfg.timeline, cfg.zmq_io_threads) == (True, False, True, 1)
    assert (cfg.bandwidth, cfg.latency) == (125e6, 0.001)
    assert (cfg.slow, cfg.fail, cfg.timeline_steps) == ((1.0, 0.2), ('step', 40), (7, 7))
    assert (cfg.hang_warn, cfg.hang_fail, cfg.ring_chunk) == (None, 5.5, None)  # 0: never
    assert Config.from_env({'D2L_BANDWIDTH': '0'}).bandwidth is None            # no link


@pytest.mark.parametrize('name,text,error', [
    ('D2L_RANK', 'one', "'one' is not a whole number"),
    ('D2L_NUM_WORKER', '-2', "'-2' is not a whole number"),
    ('D2L_ROLE', 'boss', "'boss' is not one of scheduler, server, worker"),
    ('D2L_HEARTBEAT_INTERVAL', '0', "'0' is not a positive number of seconds"),
    ('D2L_HANG_FAIL', 'soon', "'soon' is not a positive number of seconds"),
    ('D2L_SHM', 'no', "'no' is neither 1 (on) nor 0 (off)"),
    ('D2L_RING_CHUNK', '0', "'0' is not 1 or more"),
    ('D2L_BANDWIDTH', '1G', "bandwidth '1G': give a number and a unit"),
    ('D2L_LATENCY', '-1', "'-1' is not a bandwidth or latency"),
    ('D2L_SLOW', '0.5x', 'slow takes a factor of at least 1'),
    ('D2L_FAIL', 'step=0', 'fail takes step=N (N >= 1)'),
    ('D2L_TIMELINE_STEPS', '6-3', 'timeline steps take FIRST-LAST')])
def test_a_bad_value_is_one_line_naming_the_variable(name, text, error):
    with pytest.raises(ValueError) as e:
        Config.from_env({name: text})
    assert str(e.value).startswith(f'{name}: {error}') and '\n' not in str(e.value)


def test_the_launcher_writes_what_the_processes_read():
    written = config.env(role='worker', rank=1, bandwidth=125e6, timeline=True, shm=False,
                         slow='3x', timeline_steps='20-40')
    assert written == {'D2L_ROLE': 'worker', 'D2L_RANK': '1', 'D2L_BANDWIDTH': '125000000.0',
                       'D2L_TIMELINE': '1', 'D2L_SHM': '0', 'D2L_SLOW': '3x',
                       'D2L_TIMELINE_STEPS': '20-40'}
    cfg = Config.from_env(written)
    assert (cfg.role, cfg.rank, cfg.bandwidth, cfg.timeline, cfg.shm, cfg.slow,
            cfg.timeline_steps) == ('worker', 1, 125e6, True, False, (3.0, 0.0), (20, 40))
    with pytest.raises(KeyError, match='no field'):
        config.env(rol='worker')
    assert 'D2L_JOB_SECRET' in config.JOB_VARIABLES and 'D2L_SLOW' not in config.JOB_VARIABLES


def test_require_names_the_first_variable_missing():
    cfg = Config.from_env({'D2L_NUM_WORKER': '2'})
    assert cfg.require('num_worker') is cfg
    with pytest.raises(KeyError, match='D2L_NUM_SERVER'):
        cfg.require('num_worker', 'num_server', 'job_secret')


def test_a_process_reads_its_variables_once(monkeypatch):
    monkeypatch.setattr(config, '_current', None)
    monkeypatch.setenv('D2L_KILL_GRACE', '7')
    first = config.get()
    monkeypatch.setenv('D2L_KILL_GRACE', '9')      # too late: the config is frozen
    assert config.get() is first and first.kill_grace == 7.0


# ARCHITECTURE.md's table of the variables is config.py's list, row for row.
def table_row(f):
    """The line of ARCHITECTURE.md's table for one field of Config."""
    default = 'unset' if f.default is None else f'`{f.default:g}`'   # (True: 1, False: 0)
    return f'| `{config.variable(f.name)}` | {default} | {f.metadata["doc"]} |'


def test_architecture_lists_every_variable_as_config_does():
    text = (ROOT / 'ARCHITECTURE.md').read_text()
    rows = [line for line in text.splitlines() if line.startswith('| `D2L_')]
    listed = {re.match(r'\| `(D2L_\w+)`', row)[1] for row in rows}
    known = {config.variable(f.name) for f in fields(Config)}
    assert sorted(known - listed) == [], f'missing from ARCHITECTURE.md: {known - listed}'
    assert sorted(listed - known) == [], f'in ARCHITECTURE.md, not config.py: {listed - known}'
    expected = [table_row(f) for f in fields(Config)]
    assert rows == expected, 'the table should read:\n' + '\n'.join(expected)
