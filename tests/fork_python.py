"""`python ARGS` through the suite's fork server (`tests/forkserver.py`).

Usage: `python -S -E fork_python.py REAL_PYTHON ARGS...`. Runs ARGS in a
worker forked by one of the servers named in KERAS_SMP_TEST_FORKSERVER
(comma-separated socket paths; the worker's rank, from TF_CONFIG, picks
one), relays SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to its
process group, and exits as it did. Where no server answers, or the server cannot fork
this request, it becomes `REAL_PYTHON ARGS` (`exec`: the same process).
"""

import json
import os
import signal
import socket
import struct
import sys

HEADER = struct.Struct("!I")
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
           signal.SIGUSR1, signal.SIGUSR2)


def _rank():
    try:
        return int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    except (KeyError, ValueError, TypeError):
        return 0


def read_message(conn, data=b""):
    """The next length-prefixed JSON message on `conn` (`data`: bytes of it
    already read); None at the end of the stream."""
    while True:
        if len(data) >= HEADER.size:
            (size,) = HEADER.unpack_from(data)
            if len(data) >= HEADER.size + size:
                return json.loads(data[HEADER.size:HEADER.size + size])
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk


def encode(message):
    data = json.dumps(message).encode()
    return HEADER.pack(len(data)) + data


def _fallback(python, args):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)  # (exec keeps masks)
    os.execv(python, [python, *args])


def main():
    python, args = sys.argv[1], sys.argv[2:]
    # Held until the worker exists to take them (or this becomes `python`).
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    paths = [p for p in os.environ.get(
        "KERAS_SMP_TEST_FORKSERVER", "").split(",") if p]
    if not paths:
        _fallback(python, args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(paths[_rank() % len(paths)])
    except OSError:  # not started yet, or gone: a fresh interpreter
        _fallback(python, args)
    message = encode({"argv": args, "env": dict(os.environ),
                      "cwd": os.getcwd()})
    sent = socket.send_fds(conn, [message], [0, 1, 2])
    if sent < len(message):  # (a send of nothing could meet a closed peer)
        conn.sendall(message[sent:])
    reply = read_message(conn)
    if reply is None or "fallback" in reply:
        conn.close()
        _fallback(python, args)
    pid = reply["pid"]

    def relay(signum, _frame):  # to the worker's process group
        try:
            os.killpg(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    for signum in RELAYED:
        signal.signal(signum, relay)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    result = read_message(conn)
    if result is None:
        sys.stderr.write("fork_python: the fork server went away\n")
        os._exit(1)
    if "signal" in result:
        signum = result["signal"]
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal that does not end a process
    os._exit(result["exit"])


if __name__ == "__main__":
    main()
