"""Two sshfs mounts of one folder over a loopback sshd of our own: the closest stand-in for two NFS
clients on a machine whose kernel has FUSE but no NFS client (each mount keeps its own attribute
and entry caches). Used by the `netfs` test tier.

`SshfsPair.start()` installs sshfs and openssh-server with apt-get where missing (root), starts
`sshd -f <own config>` on a free high loopback port with its own host key and authorized key,
and mounts `share/` twice. `stop()` always unmounts (lazily if a plain unmount is refused) and
stops that sshd by its pid file, even after a failed start."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from coordination.net import free_port

PACKAGES = ("sshfs", "openssh-server")
SSHD = "/usr/sbin/sshd"
CACHED_OPTIONS = "cache_timeout=20,attr_timeout=20,entry_timeout=20"


def unavailable_reason() -> str | None:
    """Why this machine cannot run the tier at all (a skip), or None."""
    if os.geteuid() != 0:
        return "the netfs tier needs root (apt-get, sshd, FUSE mounts)"
    if not os.path.exists("/dev/fuse") or not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "the netfs tier needs FUSE (/dev/fuse is missing or not usable here)"
    return None


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def ensure_packages() -> None:
    """apt-get install what is missing; `apt-get update` only if the install fails without it."""
    if shutil.which("sshfs") and os.path.exists(SSHD) and shutil.which("ssh-keygen"):
        return
    res = _run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES])
    if res.returncode != 0:
        upd = _run(["apt-get", "update"])
        res = _run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES])
        if res.returncode != 0:
            raise RuntimeError(f"could not install {' '.join(PACKAGES)}: apt-get update said:\n{upd.stderr[-1500:]}\n"
                               f"apt-get install said:\n{res.stderr[-2000:]}")


class SshfsPair:
    def __init__(self, root: Path, options: str = ""):
        self.root = Path(root)
        self.options = options
        self.share = self.root / "share"
        self.mounts = (self.root / "mnt-a", self.root / "mnt-b")
        self.pid_file = self.root / "sshd.pid"
        self.port = 0

    def start(self) -> "SshfsPair":
        ensure_packages()
        for d in (self.share, *self.mounts):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.share, 0o750)
        key, host_key = self.root / "client_key", self.root / "host_key"
        for k in (key, host_key):
            _check(_run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)]), "ssh-keygen")
        auth = self.root / "authorized_keys"
        auth.write_text((self.root / "client_key.pub").read_text())
        os.chmod(auth, 0o600)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        self.port = free_port("127.0.0.1")
        conf = self.root / "sshd_config"
        conf.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {self.pid_file}",
            f"AuthorizedKeysFile {auth}", "PubkeyAuthentication yes", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no",
            "Subsystem sftp internal-sftp", ""]))
        _check(_run([SSHD, "-f", str(conf), "-E", str(self.root / "sshd.log")]), "sshd")
        deadline = time.monotonic() + 20
        while not self._listening():
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not listen on 127.0.0.1:{self.port} within 20 s; its log:\n"
                                   f"{(self.root / 'sshd.log').read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        opts = ",".join(filter(None, [f"IdentityFile={key}", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null",
                                      "BatchMode=yes", "LogLevel=ERROR", self.options]))
        for m in self.mounts:
            _check(_run(["sshfs", "-p", str(self.port), "-o", opts, f"root@127.0.0.1:{self.share}", str(m)], 60),
                   f"sshfs mount of {m}")
            if not os.path.ismount(m):
                raise RuntimeError(f"sshfs returned but {m} is not a mount point")
        return self

    def _listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> list[str]:
        """Unmount both mounts and stop our sshd; returns what could not be cleaned (for the report)."""
        problems = []
        for m in self.mounts:
            if not os.path.ismount(m):
                continue
            for cmd in (["fusermount3", "-u", str(m)], ["fusermount", "-u", str(m)], ["fusermount3", "-u", "-z", str(m)],
                        ["umount", "-l", str(m)]):
                if shutil.which(cmd[0]) and _run(cmd, 30).returncode == 0 and not os.path.ismount(m):
                    break
            if os.path.ismount(m):
                problems.append(f"{m} is still mounted")
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            pid = None  # sshd never started (or never wrote its pid): nothing of ours to stop
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return problems


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours counts as gone (sshd daemonizes, so it is not our child).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _check(res: subprocess.CompletedProcess, what: str) -> None:
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}")
