"""The first program every child of a node runs: `python -I -S exec_shim.py PARENT FD -- COMMAND...`.

It exists so that no Python code of the node ever runs between fork and exec. A node has threads
(heartbeat, peer watch, metric sinks); a forked copy of it holds every lock those threads held at
that instant, so a `preexec_fn` that imports a module can wait forever on an import lock whose
owner does not exist in the child (docs/design.md §2). The node's `subprocess.Popen` therefore
forks and execs in C straight into this script, a fresh single-threaded interpreter, which:

1. asks the kernel to SIGTERM it when its parent dies (PR_SET_PDEATHSIG survives the exec below,
   so it holds for the real child: a node killed by SIGKILL leaves no torchrun or server behind);
2. exits if the parent is already gone (it died before step 1, so no signal would ever come);
3. marks FD close-on-exec and execs COMMAND; the parent sees FD close (EOF) the moment the exec
   succeeds, or reads the error when it fails.

Run with -I -S: nothing from the environment, the current folder or site-packages is imported.
"""
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_GONE = 125  # the exit code when the parent died before the death signal was armed


def main() -> None:
    parent, fd, sep, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    if sep != "--" or not argv:
        os.write(2, b"exec_shim: usage: exec_shim.py PARENT_PID STATUS_FD -- COMMAND...\n")
        os._exit(2)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            os.write(fd, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}".encode())
            os._exit(127)
    if os.getppid() != parent:
        os._exit(PARENT_GONE)
    os.set_inheritable(fd, False)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(fd, f"cannot execute {argv[0]}: {exc.strerror} (errno {exc.errno})".encode())
        os._exit(127)


if __name__ == "__main__":
    main()
