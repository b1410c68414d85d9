"""Starts one sandboxed worker: ``python -I -S sandbox_exec.py SPEC_JSON``, run by ``rollout.sandbox``.

Standard library only, and run as a file without ``site``: it starts in a few milliseconds and imports nothing a
tool could have shadowed. SPEC_JSON (no secrets: the command line is public) holds ``mode``, ``argv`` (the worker
command), ``folder`` (the worker's own folder), ``parent`` (the pid that must still be our parent), ``report``
(the descriptor for this program's own messages), ``limits`` (resource -> value), ``no_network``,
``private_tmp``, ``needed`` (folders bound back, read-only, under a private /tmp), ``tmp_bytes`` and ``probe``
(set everything up, then exit 0 instead of running ``argv``). The environment it is started with is the
worker's: the caller allowlists it.

Every mode: the parent-death signal (SIGKILL when the parent dies), no new privileges, the folder as working
directory. ``rlimits-only`` adds the resource limits and execs the worker in this process. ``namespace``:

    launcher (outside)  -- unshares user, mount, PID, IPC [, network] namespaces; a forked helper, still outside,
      |                    writes the uid/gid maps (root: the namespace's uid 0 is the unprivileged uid 65534
      |                    outside, so the kernel's process limit holds, and its uid 1 is root, so root's files
      |                    stay readable)
      +-- init (pid 1)  -- mounts: everything read-only, a fresh /proc, the folder writable [, empty /tmp];
            |              limits; drops every capability but reading files; reaps orphans
            +-- worker  -- the command; everything it starts stays in the namespace
Killing init ends the namespace: the kernel kills every process in it first, ``setsid`` or not. Init exits with
the worker's status (128 + signal when it was killed), and the launcher with init's.

The report descriptor carries JSON lines: ``{"init": PID}`` (init's pid outside the namespace) and ``{"error":
...}`` when setting up failed (exit code 125). It reaches end of file once the worker command runs (or the probe
is done): no process of the worker's keeps it.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

SANDBOX_UID = 65534  # "nobody": the outside uid of a root run's sandboxed processes
SETUP_FAILED = 125

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 24, 38, 47, 4
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
CAP_DAC_READ_SEARCH = 2
CAPS_V3 = 0x20080522
LIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "nproc": resource.RLIMIT_NPROC,
    "core": resource.RLIMIT_CORE,
}

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what} failed: {os.strerror(err)} (errno {err})")


_report = -1  # the report descriptor


def _say(**message: object) -> None:
    os.write(_report, (json.dumps(message) + "\n").encode())


def _fail(message: str) -> None:
    _say(error=message)
    os._exit(SETUP_FAILED)


def _die_with_parent() -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def _no_new_privs() -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _set_limits(limits: dict[str, int]) -> None:
    for name, value in limits.items():
        try:
            resource.setrlimit(LIMITS[name], (value, value + 1 if name == "cpu" else value))
        except (ValueError, OSError) as e:
            raise SetupError(f"setrlimit({name}={value}) failed: {e}") from None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _set_readonly(path: str, readonly: bool, recursive: bool) -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else MOUNT_ATTR_RDONLY, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    result = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr))
    _check(result, f"mount_setattr({path}, {'read-only' if readonly else 'writable'})")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _keep_only_caps(keep: set[int]) -> None:
    """Every capability not in ``keep`` leaves the bounding set (so no exec regains it) and the current sets."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        if cap not in keep:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    mask = sum(1 << cap for cap in keep)
    data = (_CapData * 2)(_CapData(mask, mask, 0), _CapData(0, 0, 0))
    _check(_libc.capset(ctypes.byref(_CapHeader(CAPS_V3, 0)), data), "capset")


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _map_ids(pid: int, uid: int, gid: int, folder: str) -> None:
    """Run outside the namespace, for ``pid`` inside it: who its processes are."""
    if uid == 0:
        os.chown(folder, SANDBOX_UID, SANDBOX_UID)
        _write(f"/proc/{pid}/uid_map", f"0 {SANDBOX_UID} 1\n1 0 1\n")
        _write(f"/proc/{pid}/gid_map", f"0 {SANDBOX_UID} 1\n1 0 1\n")
    else:  # an unprivileged user may map only itself
        _write(f"/proc/{pid}/setgroups", "deny")
        _write(f"/proc/{pid}/uid_map", f"0 {uid} 1\n")
        _write(f"/proc/{pid}/gid_map", f"0 {gid} 1\n")


def _exit_status(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _namespace(spec: dict) -> None:
    uid, gid, folder = os.getuid(), os.getgid(), spec["folder"]
    unshared_r, unshared_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(unshared_w)
        if os.read(unshared_r, 1) != b"x":
            os._exit(1)
        try:
            _map_ids(os.getppid(), uid, gid, folder)
        except OSError as e:
            _say(error=f"writing the uid/gid maps failed: {e}")
            os._exit(1)
        os._exit(0)
    os.close(unshared_r)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (CLONE_NEWNET if spec["no_network"] else 0)
    unshared = _libc.unshare(flags)
    os.write(unshared_w, b"x" if unshared == 0 else b"-")  # "-": nothing to map, the helper just exits
    os.close(unshared_w)
    _check(unshared, "unshare(user, mount, pid, IPC" + (", network)" if spec["no_network"] else ")"))
    if _exit_status(os.waitpid(helper, 0)[1]) != 0:
        raise SetupError("the namespace's uid/gid maps could not be written")
    if uid == 0:  # become the namespace's root: uid 65534 outside
        os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
    go_r, go_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(go_w)
        try:
            _init(spec, go_r, keep={CAP_DAC_READ_SEARCH} if uid == 0 else set())
        except SetupError as e:
            _fail(str(e))
    os.close(go_r)
    _say(init=init)
    os.close(_report)
    os.write(go_w, b"x")
    os.close(go_w)
    os._exit(_exit_status(os.waitpid(init, 0)[1]))


def _init(spec: dict, go: int, keep: set[int]) -> None:
    _die_with_parent()
    if os.read(go, 1) != b"x":
        os._exit(1)
    os.close(go)
    folder = spec["folder"]
    folder_fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks out, nothing outside leaks in
    _set_readonly("/", True, recursive=True)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if spec["private_tmp"]:
        private = [path for path in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(path)]
        # What the worker needs to start (its interpreter, its import path) may live under a folder about to be
        # hidden: held open now, bound back read-only over the empty one.
        hidden = [p for p in spec["needed"] if any(p.startswith(d + "/") for d in private)]
        held = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in hidden}
        for path in private:
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=" + str(spec["tmp_bytes"]))
        for path, fd in held.items():
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            _set_readonly(path, True, recursive=True)
            os.close(fd)
    os.makedirs(folder, exist_ok=True)  # absent only where an empty /tmp now hides it
    _mount(f"/proc/self/fd/{folder_fd}", folder, None, MS_BIND)
    _set_readonly(folder, False, recursive=False)  # a bind mount starts with its source's read-only flag
    os.close(folder_fd)
    os.chdir(folder)
    limits = dict(spec["limits"])
    if "nproc" in limits:  # the launcher and init count too
        limits["nproc"] += 2
    _set_limits(limits)
    _keep_only_caps(keep)
    _no_new_privs()
    if spec["probe"]:
        os._exit(0)
    worker = os.fork()
    if worker == 0:
        _die_with_parent()
        _exec(spec["argv"])
    os.close(_report)
    # Init holds no end of the worker's pipes: the caller sees EOF as soon as the worker is gone.
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    while True:  # pid 1 reaps every orphan; it ends with the worker (and so does the namespace)
        pid, status = os.wait()
        if pid == worker:
            os._exit(_exit_status(status))


def _exec(argv: list[str]) -> None:
    try:
        os.execv(argv[0], argv)  # the report descriptor is close-on-exec: its end of file says "running"
    except OSError as e:
        _fail(f"cannot run {argv[0]}: {e}")


def main(spec: dict) -> None:
    global _report
    _report = spec["report"]
    os.set_inheritable(_report, False)
    try:
        _die_with_parent()
        if os.getppid() != spec["parent"]:  # the parent died before the signal was armed
            os._exit(1)
        if spec["mode"] == "namespace":
            _namespace(spec)
        os.chdir(spec["folder"])
        if spec["mode"] == "rlimits-only":
            _set_limits(spec["limits"])
        _no_new_privs()
    except (SetupError, OSError) as e:
        _fail(str(e))
    if spec["probe"]:
        os._exit(0)
    _exec(spec["argv"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
