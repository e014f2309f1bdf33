"""The library's log records in Python's `logging`: logger names ``kvstage.<target>``, levels
mapped, the session in the message and as an attribute. Engines on 127.0.0.1 in this process."""

import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import kvref
import kvstage
from kvstage import _logging

MODEL = kvref.Model(layers=2, heads=2, head_dim=8, dtype_bytes=2, page_size=4)


@pytest.fixture
def routed(lib):
    """Records at INFO and above reach `logging`; the default routing is restored afterwards."""
    assert kvstage.route_logs_to_python(logging.INFO) == _logging.LOG_INFO
    yield lib
    kvstage.route_logs_to_python()


def _engine(transport, **options):
    _, layout = kvref.make_pool(MODEL, 0, 1, 8)
    engine = kvstage.Engine(transport=transport, **options)
    engine.register_pool(layout)  # the engine keeps the pool's memory referenced
    return engine


def _records(caplog, name, level=None):
    return [r for r in caplog.records if r.name == name and (level is None or r.levelno == level)]


def test_a_downgrade_is_one_warning_per_path_not_taken(routed, caplog):
    caplog.set_level(logging.INFO, logger="kvstage")
    decode = _engine(kvstage.Transport.TCP)
    prefill = _engine(kvstage.Transport.AUTO)
    try:
        session = prefill.connect(decode.listen_address, "py-downgrade")
        session.close()
    finally:
        prefill.close()
        decode.close()
    warnings = [r for r in caplog.records if r.name.startswith("kvstage") and r.levelno >= logging.WARNING]
    # The decode engine's transport is TCP: it refuses the same-host path, then RDMA.
    assert len(warnings) == 2, [r.getMessage() for r in warnings]
    shm, w = warnings
    assert shm.name == "kvstage.transport.shm"
    assert shm.getMessage().startswith("session py-downgrade: same-host path not used")
    assert "does not serve the same-host path" in shm.getMessage()
    assert w.name == "kvstage.transport.rdma"
    assert w.levelname == "WARNING"
    assert w.getMessage().startswith("session py-downgrade: downgraded from rdma to tcp")
    assert "no local RDMA device" in w.getMessage() or "does not serve RDMA" in w.getMessage()
    assert w.kvstage_session == "py-downgrade"
    assert w.kvstage_target == "kvstage::transport::rdma"
    opened = _records(caplog, "kvstage.session.sender", logging.INFO)
    assert any(r.getMessage().startswith("session py-downgrade: session opened to ") and "over tcp" in r.getMessage() for r in opened)


def test_an_expired_room_is_one_warning_with_its_cause(routed, caplog):
    caplog.set_level(logging.INFO, logger="kvstage")
    decode = _engine(kvstage.Transport.TCP, room_timeout_ms=300)
    try:
        room = decode.open_room(9, [0, 1, 2, 3], chunk_tokens=16)
        with pytest.raises(kvstage.TimeError):
            room.wait(timeout_ms=10_000)
        # Logged by the engine's thread before it wakes the waiter; bounded wait all the same.
        deadline = time.monotonic() + 5
        while not _records(caplog, "kvstage.session.receiver", logging.WARNING) and time.monotonic() < deadline:
            time.sleep(0.01)
        room.release()
    finally:
        decode.close()
    (r,) = _records(caplog, "kvstage.session.receiver", logging.WARNING)
    # Its trace id (derived from the opening: no sender named one) first, as in every line about it.
    assert re.fullmatch(r"\[9#[0-9a-f]{4}\] room 9 failed \(KVSTAGE_E_TIMEOUT\): the room's deadline passed \(0 of 1 chunks done\)", r.getMessage()), r.getMessage()
    assert r.kvstage_session == ""


def test_the_library_level_follows_the_argument(routed, caplog):
    caplog.set_level(kvstage.TRACE, logger="kvstage")
    assert kvstage.route_logs_to_python("warn") == _logging.LOG_WARN
    decode = _engine(kvstage.Transport.TCP)
    decode.close()
    # Engine lifecycle records are INFO: not handed over at WARN.
    assert not [r for r in caplog.records if r.name.startswith("kvstage") and r.levelno < logging.WARNING]
    assert kvstage.route_logs_to_python(logging.DEBUG) == _logging.LOG_DEBUG
    decode = _engine(kvstage.Transport.TCP)
    decode.close()
    assert any(r.name == "kvstage.engine" and r.levelno == logging.INFO and "engine listening on" in r.getMessage() for r in caplog.records)
    assert kvstage.TRACE == 5
    with pytest.raises(kvstage.ArgumentError):
        kvstage.route_logs_to_python("loud")


def test_every_level_maps_to_its_logging_level(routed, caplog):
    fn = getattr(routed, "kvstage_testing_log", None)
    if fn is None:
        pytest.skip("needs the test-only exports (cargo feature `testing`)")
    caplog.set_level(kvstage.TRACE, logger="kvstage")
    kvstage.route_logs_to_python(kvstage.TRACE)
    for level in range(1, 6):
        assert fn(level, b"s-%d" % level, b"level %d" % level) == 0
    assert fn(0, None, b"x") == kvstage.Status.E_INVALID_ARG
    got = [(r.name, r.levelno, r.getMessage(), r.kvstage_session) for r in caplog.records if r.name == "kvstage.testing"]
    assert got == [
        ("kvstage.testing", logging.ERROR, "session s-1: level 1", "s-1"),
        ("kvstage.testing", logging.WARNING, "session s-2: level 2", "s-2"),
        ("kvstage.testing", logging.INFO, "session s-3: level 3", "s-3"),
        ("kvstage.testing", logging.DEBUG, "session s-4: level 4", "s-4"),
        ("kvstage.testing", kvstage.TRACE, "session s-5: level 5", "s-5"),
    ]
    # Back to stderr: nothing more reaches `logging`.
    kvstage.route_logs_to_stderr()
    caplog.clear()
    assert fn(4, None, b"below the stderr level") == 0
    assert not [r for r in caplog.records if r.name == "kvstage.testing"]


def test_names_and_levels():
    assert _logging.logger_name("kvstage::transport::rdma") == "kvstage.transport.rdma"
    assert _logging.logger_name("kvstage") == "kvstage"
    assert _logging.logger_name("other::thing") == "kvstage.other.thing"
    assert [_logging.python_level(v) for v in range(1, 6)] == [logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG, 5]
    assert _logging.library_level(logging.WARNING) == _logging.LOG_WARN
    assert _logging.library_level(logging.ERROR) == _logging.LOG_ERROR
    assert _logging.library_level(logging.CRITICAL) == _logging.LOG_ERROR
    assert _logging.library_level(logging.CRITICAL + 1) == _logging.LOG_OFF
    assert _logging.library_level(logging.DEBUG) == _logging.LOG_DEBUG
    assert _logging.library_level(1) == _logging.LOG_TRACE


_CHILD = textwrap.dedent(
    """
    import kvref, kvstage
    model = kvref.Model(layers=2, heads=2, head_dim=8, dtype_bytes=2, page_size=4)
    engines = []
    for transport in (kvstage.Transport.TCP, kvstage.Transport.AUTO):
        _, layout = kvref.make_pool(model, 0, 1, 8)
        e = kvstage.Engine(transport=transport)
        e.register_pool(layout)
        engines.append((e, layout))
    (decode, _), (prefill, _) = engines
    prefill.connect(decode.listen_address, "py-child").close()
    prefill.close()
    decode.close()
    """
)


@pytest.mark.parametrize("python_logging", ["1", "0"])
def test_records_reach_stderr_through_logging_or_the_library(child_env, python_logging):
    env = dict(child_env)
    env.pop("KVSTAGE_LOG", None)
    env["KVSTAGE_PYTHON_LOGGING"] = python_logging
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    # Two downgrades (the decode engine's transport is TCP): the same-host path, then RDMA.
    assert len(lines) == 2, out.stderr
    if python_logging == "1":
        # logging's last-resort handler: the message only.
        assert lines[0].startswith("session py-child: same-host path not used"), out.stderr
        assert lines[1].startswith("session py-child: downgraded from rdma to tcp"), out.stderr
    else:
        assert " WARN kvstage::transport::shm: session py-child: same-host path not used" in lines[0], out.stderr
        assert " WARN kvstage::transport::rdma: session py-child: downgraded from rdma to tcp" in lines[1], out.stderr


_NOISY_CHILD = textwrap.dedent(
    """
    import signal
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as in a C program: SIGPIPE ends the process
    import kvref, kvstage
    model = kvref.Model(layers=2, heads=2, head_dim=8, dtype_bytes=2, page_size=4)
    for _ in range(3):
        _, layout = kvref.make_pool(model, 0, 1, 8)
        decode = kvstage.Engine(transport=kvstage.Transport.TCP)
        decode.register_pool(layout)
        prefill = kvstage.Engine(transport=kvstage.Transport.TCP)
        prefill.register_pool(layout)
        prefill.connect(decode.listen_address, "noisy").close()
        prefill.close()
        decode.close()
    print("alive", flush=True)
    """
)


@pytest.mark.parametrize("stderr_is", ["closed", "full"])
def test_a_stderr_nobody_reads_neither_blocks_nor_kills_the_process(child_env, stderr_is):
    """The library's stderr lines (debug level) go to a pipe whose reader is gone (a write raises
    SIGPIPE, whose default action ends a C program) or to a full pipe nobody reads (a write
    blocks): the process runs to its end either way, the lines dropped."""
    import fcntl

    env = dict(child_env, KVSTAGE_LOG="debug", KVSTAGE_PYTHON_LOGGING="0")
    r, w = os.pipe()
    try:
        if stderr_is == "closed":
            os.close(r)
            r = None
        else:
            fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
            try:
                while True:
                    os.write(w, b"x" * 4096)
            except BlockingIOError:
                pass
            fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        child = subprocess.Popen([sys.executable, "-c", _NOISY_CHILD], env=env, stdout=subprocess.PIPE, stderr=w, text=True)
        try:
            out, _ = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            pytest.fail(f"the process blocked writing its log to a {stderr_is} stderr")
        assert child.returncode == 0 and out.strip() == "alive", f"{stderr_is} stderr: exit {child.returncode}, stdout {out!r}"
    finally:
        os.close(w)
        if r is not None:
            os.close(r)
