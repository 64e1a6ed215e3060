"""Ties a server's whole process group to the life of the process that started it (run as a script).

``python guard.py CMD...`` starts CMD in a new session (its own process group: the vLLM API server and
the engine-core processes it forks), prints its pid on one line, then waits. It ends the group, SIGTERM
then SIGKILL after a grace period, when

* its stdin reaches end-of-file: the parent closed the pipe (:meth:`cope.rollout.vllm.server.ManagedServer.stop`)
  or the parent died, however (an exception, SIGTERM, SIGKILL, an OOM kill): the kernel closes the
  parent's end of the pipe in every case, so no server outlives its trainer;
* it gets SIGTERM, SIGINT or SIGHUP itself (a Ctrl-C in the terminal reaches the trainer and this guard,
  not the server's own group).

When the server exits by itself, the guard ends what is left of its group and exits with its code.
Stdlib only: it runs under any interpreter, imports nothing from cope or vLLM.
"""
import os
import signal
import subprocess
import sys
import threading

GRACE_S = float(os.environ.get("COPE_VLLM_GRACE_S", "10"))


def end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left after the grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:  # the leader may be gone while forked children still run: the group id stays theirs
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> None:
    # stdout is the pipe the parent reads the pid from: the server writes both streams to our stderr (its log)
    proc = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=sys.stderr, start_new_session=True)
    print(proc.pid, flush=True)
    lock = threading.RLock()  # re-entrant: a signal handler may run on the thread that holds it

    def shutdown(code: int) -> None:
        with lock:
            end_group(proc)
            os._exit(code)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: shutdown(128 + signum))

    def watch_parent() -> None:
        try:
            while sys.stdin.buffer.read(1):
                pass
        except OSError:
            pass
        shutdown(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    rc = proc.wait()
    with lock:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os._exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main()
