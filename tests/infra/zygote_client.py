"""A container's command when its program is forked from the zygote (zygote.py): `python -I -S zygote_client.py
NAME -- ARGV...`. The standard library only, so it starts in milliseconds. It hands ARGV, its environment, working
directory and standard streams to the zygote at the abstract socket NAME, passes on SIGTERM and SIGINT, and ends as
the forked instance ended. With no zygote to answer, it runs ARGV itself."""

import json
import os
import signal
import socket
import sys

if __name__ == "__main__":
    name, argv = sys.argv[1], sys.argv[3:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + name)
    except OSError:
        os.execvp(argv[0], argv)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])

    def pass_on(signum, _frame):
        conn.sendall(json.dumps({"signal": signum}).encode() + b"\n")

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    reply, code = b"", None
    while code is None:  # {"pid"} at the fork, then {"exit"}
        more = conn.recv(4096)
        if not more:
            print("zygote client: the zygote's keeper ended without the instance's status", file=sys.stderr)
            sys.exit(1)
        reply += more
        for line in reply.split(b"\n")[:-1]:
            code = json.loads(line).get("exit", code)
        reply = reply.rsplit(b"\n", 1)[-1]
    if code < 0:  # ended by a signal: end by the same one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code & 0xFF if code >= 0 else 128 - code)
