"""The sandbox: run the model's Python code in a child process that can reach nothing of ours.

Standard library only, nothing from the project: any interpreter can import this file. A call uses
the best of three tiers the machine gives; `ALLOWED` (set once from the `sandbox` setting, before
the reward workers fork) is the weakest it may use. Below it a call fails: no code runs unsandboxed.

    full        network, PID, mount, IPC (SysV shared memory, semaphores) and UTS namespaces; a
                uid of its own (as root); a file view holding only /usr (/bin, /lib...) and
                Python's installation with every *-packages folder hidden, /dev/null, /dev/zero,
                /dev/urandom, its own /proc and a private /tmp: no /etc, /home, project or data
    namespaces  the namespaces, a uid of its own, private /tmp, /var/tmp, /dev/shm and /run/lock;
                every world-readable file readable, and a unix socket in a host folder (a daemon's,
                if its permissions let others in) reachable: the network namespace does not cover
                sockets that are files
    none        a plain child process: the network and every file this user can read

Every tier: the base interpreter by its real path with -I (the code needs just the stdlib),
limits per process (address space, CPU seconds, file size, no core), a deadline on every wait, a cap
on the bytes read from the child, and nothing left running when a call ends or its caller dies: the
process group is killed, the first process of a PID namespace takes the rest with it, and each link
(caller -> unshare -> sandbox) carries a parent-death signal. Memory and processes are bounded per
sandbox: as root by a cgroup of its own (memory and pids; cgroup v2 where it has those controllers,
else v1); elsewhere only per process, RLIMIT_AS times RLIMIT_NPROC of 8 (counted per sandbox in a
user namespace of its own, or by its own uid as root; else per user).
Not contained: a kernel exploit, what /usr and the standard library show (the OS, not our data), CPU
time within the CPU-seconds limit, and in the weaker tiers what their lines above leave open.
"""

import contextlib
import ctypes
import functools
import glob
import itertools
import math
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time

TIERS = ("none", "namespaces", "full")  # weakest first
GIVES = {"full": "no network, no file but the OS and Python's standard library",
         "namespaces": "no network, but the code reads every world-readable file (project, data) "
                       "and can connect to a unix socket it may open in a host folder",
         "none": "no isolation: the code runs as this user, with the network and every file"}
ALLOWED = "full"  # the weakest tier a call may use; a process that never sets it gets the strictest
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}  # no secret of our environment
MAX_RESULT_BYTES = 1 << 20  # run_tests reads at most this much of the harness's output
UID_BASE = 1 << 30  # as root, a sandbox's own uid: UID_BASE + caller's pid * 64 + a count % 64
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "urandom")
WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/crash")
_COUNT = itertools.count()
_BEST = None  # (tier, why the stronger ones failed), probed once per process: best()
_CGROUPS = None  # {controller: (cgroup version, our cgroup's folder)}: _cgroup_bases()
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


class SandboxError(RuntimeError):
    """The tier ALLOWED cannot be had here; the message says why and what to do."""


def die_with_parent(parent):
    """Linux: SIGKILL this process when its parent dies (by kill -9 too); now if it already has."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # it died between the fork and the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def become_subreaper():
    """Linux: orphaned descendants (a double-forked daemon too) become this process's children."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1)


# ---------------------------------------------------------------- the file view


def _under(path, tree):
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def _interpreter():
    """The base interpreter's real path: a venv's python, or a symlink to it, is not in the view."""
    return os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)


@functools.cache
def _trees():
    """The host folders the view binds read-only: the OS's programs and libraries, and Python."""
    trees = {d for d in SYSTEM if os.path.isdir(d) and not os.path.islink(d)}
    python = (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(_interpreter()))
    trees |= {os.path.realpath(d) for d in python}
    return tuple(sorted(t for t in trees if not any(_under(t, u) for u in trees if u != t)))


def _package_dirs(trees):
    """Every *-packages folder in the trees: the base Python's, /usr/lib/python3/dist-packages, a
    Python bundled deep in /usr/lib... (one walk: ~1 s for 15k folders, once per process)."""
    found = {p for p in sys.path if p.endswith("-packages")}
    for tree in trees:
        for folder, subfolders, _ in os.walk(tree):
            found.update(os.path.join(folder, d) for d in subfolders if d.endswith("-packages"))
            subfolders[:] = [d for d in subfolders if not d.endswith("-packages")]
    real = {os.path.realpath(p) for p in found if os.path.isdir(p)}
    return sorted(p for p in real if any(_under(p, t) for t in trees))


@functools.cache
def _file_view(shown=()):
    """Shell lines that build the sandbox's filesystem on a fresh tmpfs and pivot_root into it.

    shown: more host paths (folders or files, real paths) in view, read-only: a library scorer's
    installed packages and the source files of the modules its task imports (Scorer), no data.
    The tmpfs goes on a folder that neither holds nor lies in a bound path (a venv, even Python, may
    live under /tmp), and the private /tmp is mounted before the binds: nothing bound is hidden.
    """
    q, trees = shlex.quote, _trees()
    extra = [p for p in shown if not any(_under(p, t) for t in trees)]  # not bound with a tree
    stages = [d for d in ("/tmp", "/mnt", "/media", "/srv", "/opt", "/var/tmp", "/run", "/dev/shm")
              if os.path.isdir(d) and os.path.realpath(d) == d
              and not any(_under(t, d) or _under(d, t) for t in [*trees, *extra])]
    if not stages:
        raise SandboxError(f"no folder to build the file view in, apart from {trees}")
    stage = q(stages[0])
    lines = ["set -e", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
             f"mount -t tmpfs -o size=64m tmpfs {stage}",
             f"cd {stage}", "mkdir dev proc tmp old", "mount -t tmpfs -o size=64m tmpfs tmp"]
    lines += [f"mkdir -p {q('.' + t)} && mount --rbind -o ro {q(t)} {q('.' + t)}" for t in trees]
    # a merged-/usr system: /lib -> usr/lib
    lines += [f"ln -s {q(os.readlink(d))} .{d}" for d in SYSTEM if os.path.islink(d)]
    for p in extra:  # a folder as a tree is; a file on an empty file of its own
        make = f"mkdir -p {q('.' + p)}" if os.path.isdir(p) else \
            f"mkdir -p {q('.' + os.path.dirname(p))} && touch {q('.' + p)}"
        lines.append(f"{make} && mount --rbind -o ro {q(p)} {q('.' + p)}")
    # installed packages: hidden (the harnesses need the standard library only), unless shown
    hidden = [p for p in _package_dirs(trees) if p not in shown]
    lines += [f"mount -t tmpfs -o ro,size=1m tmpfs {q('.' + p)}" for p in hidden]
    lines += [f"touch dev/{d} && mount --bind /dev/{d} dev/{d}" for d in DEVICES]
    # the old root is detached once /proc (which umount reads) is the sandbox's own
    return "; ".join([*lines, "pivot_root . old", "mount -t proc proc /proc", "umount -l /old",
                      "rmdir /old"])


def _command(tier, uid, shown=()):
    """The argv prefix that runs a program in `tier`, as `uid` when we are root; shown: host paths
    the full tier's file view adds (_file_view)."""
    if tier == "none":
        return []
    root, drop = os.geteuid() == 0, "exec"  # not root: in a user namespace, whose root is this user
    if root:  # the kernel clears a parent-death signal on a uid change: setpriv sets it again after
        setpriv = shutil.which("setpriv")
        drop += f" {setpriv} --reuid={uid} --regid={uid} --clear-groups --pdeathsig=KILL"
    # the world-writable folders of a host: private, so nothing is left there or read from there
    private = [d for d in WRITABLE if os.path.isdir(d) and os.path.realpath(d) == d
               and not any(_under(t, d) for t in _trees())]
    mounts = "; ".join(f"mount -t tmpfs -o size=64m tmpfs {d}" for d in private)
    setup = _file_view(shown) if tier == "full" else mounts
    # --kill-child + --pid: when the sandbox's first process dies, the kernel kills all it forked
    # --ipc, --uts: SysV shared memory, semaphores and queues, and the host name, of its own
    unshare = [shutil.which("unshare"), *([] if root else ["--map-root-user"]), "--net", "--pid",
               "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
    return [*unshare, shutil.which("sh"), "-c", f'{setup}; cd /tmp && {drop} "$@"', "sandbox"]


def _probe(tier):
    """None if `tier` works here, else why not (what its command printed)."""
    if sys.platform != "linux":
        return f"namespaces are Linux-only (this is {sys.platform})"
    for tool in ("unshare", "setpriv") if os.geteuid() == 0 else ("unshare",):
        if not shutil.which(tool):
            return f"util-linux's {tool} is not installed"
    if not shutil.which("sh"):
        return "no sh on PATH"
    try:
        cmd = [*_command(tier, UID_BASE), _interpreter(), "-I", "-c", "pass"]
        probe = subprocess.run(cmd, capture_output=True, timeout=30, env=ENV, cwd="/tmp")
    except (SandboxError, OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    said = probe.stderr.decode(errors="replace").strip()[-300:]
    return None if probe.returncode == 0 else said or f"exit code {probe.returncode}"


def best():
    """(the strongest tier this machine gives, why each stronger one failed), probed once."""
    global _BEST
    if _BEST is None:
        tier, why = "none", []
        for candidate in ("full", "namespaces"):
            error = _probe(candidate)
            if error is None:
                tier = candidate
                break
            why.append(f"the {candidate} sandbox failed: {error}")
        _BEST = tier, "; ".join(why)
        _cgroup_bases()  # probed with the tier, so forked reward workers inherit both
    return _BEST


# ---------------------------------------------------------------- cgroups: limits per sandbox


def _cgroup_bases():
    """{"memory" / "pids": (version, our cgroup's folder)} where we may make child cgroups (root
    only); probed once per process, when stale cgroups of a caller that died are removed."""
    global _CGROUPS
    if _CGROUPS is not None:
        return _CGROUPS
    _CGROUPS, v1, v2 = {}, {}, {}
    if sys.platform != "linux" or os.geteuid() != 0:
        return _CGROUPS
    with open("/proc/self/cgroup") as f:  # "id:controllers:path", cgroup v2 as "0::path"
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    ours = {c: path for _, controllers, path in lines for c in controllers.split(",")}
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for m in mounts:
        root, point, kind, options = m[3], m[4], m[m.index("-") + 1], m[m.index("-") + 3]
        for c in ("memory", "pids"):
            path = ours.get("" if kind == "cgroup2" else c)
            if path is None or not _under(path, root):
                continue
            base = os.path.normpath(os.path.join(point, os.path.relpath(path, root)))
            if kind == "cgroup" and c in options.split(",") and os.access(base, os.W_OK):
                v1[c] = (1, base)
            elif kind == "cgroup2" and c in _read(base, "cgroup.subtree_control").split():
                v2[c] = (2, base)
    _CGROUPS = {**v1, **v2}
    for _, base in _CGROUPS.values():
        for stale in glob.glob(os.path.join(base, "grpo-sandbox-*-*")):
            if not os.path.exists(f"/proc/{stale.rsplit('-', 2)[1]}"):
                _remove_cgroup(stale)
    return _CGROUPS


def _read(folder, name):
    try:
        with open(os.path.join(folder, name)) as f:
            return f.read()
    except OSError:
        return ""


def _write(folder, name, value):
    with open(os.path.join(folder, name), "w") as f:
        f.write(str(value))


def _make_cgroups(memory_mb, procs):
    """Folders of a new cgroup (one per hierarchy) bounding a sandbox's memory and processes."""
    folders, name = {}, f"grpo-sandbox-{os.getpid()}-{next(_COUNT)}"
    for controller, (version, base) in _cgroup_bases().items():
        folders.setdefault(os.path.join(base, name), (version, set()))[1].add(controller)
    for folder, (version, controllers) in folders.items():
        with contextlib.suppress(FileExistsError):  # left by a caller that died, with our pid
            os.mkdir(folder)
        if "pids" in controllers:
            _write(folder, "pids.max", procs)
        size = memory_mb << 20
        limits = {"memory.max": size, "memory.swap.max": 0} if version == 2 else \
            {"memory.limit_in_bytes": size, "memory.memsw.limit_in_bytes": size}
        for file, limit in limits.items() if "memory" in controllers else ():
            if os.path.exists(os.path.join(folder, file)):  # swap only where the kernel counts it
                _write(folder, file, limit)
    return list(folders)


def _remove_cgroup(folder):
    """Kill what is left in a sandbox's cgroup and remove it (the killed take a moment to go)."""
    for _ in range(200):
        for pid in _read(folder, "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.rmdir(folder)
            return
        time.sleep(0.01)


# ---------------------------------------------------------------- running code


def _start(harness, stderr, timeout, memory_mb, shown=()):
    """Start `harness` in the best tier: (process, its cgroups, the limits it sets on itself).
    timeout None: no CPU-seconds limit (a server, whose calls set their own)."""
    tier, why = best()
    if TIERS.index(tier) < TIERS.index(ALLOWED):
        raise SandboxError(f"the {ALLOWED} sandbox cannot be built here ({why}); set "
                           f"sandbox={tier} to accept {GIVES[tier]}")
    procs = 64 if "memory" in _cgroup_bases() else 8  # else RLIMIT_AS x procs bounds the memory
    limits = {"RLIMIT_AS": memory_mb << 20, "RLIMIT_FSIZE": 1 << 20, "RLIMIT_NPROC": procs,
              "RLIMIT_CORE": 0}
    if timeout is not None:
        limits["RLIMIT_CPU"] = math.ceil(timeout) + 1
    cgroups, parent = [], os.getpid()

    def enter():  # in the child before exec: all the sandbox starts is in its cgroups
        die_with_parent(parent)
        for folder in cgroups:
            _write(folder, "cgroup.procs", os.getpid())

    uid = UID_BASE + parent * 64 + next(_COUNT) % 64
    try:
        cgroups += _make_cgroups(memory_mb, procs)
        proc = subprocess.Popen([*_command(tier, uid, shown), _interpreter(), "-I", "-c", harness],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                env=ENV, cwd="/tmp", start_new_session=True, preexec_fn=enter)
    except (OSError, subprocess.SubprocessError) as e:
        for folder in cgroups:
            _remove_cgroup(folder)
        raise SandboxError(f"the sandbox did not start: {e}") from e
    return proc, cgroups, limits


def _exchange(proc, data, deadline, cap):
    """Write `data` to the process; read its output until it exits, `cap` bytes or the deadline.

    Returns (output, how): how is "done" (it exited), "output limit" or "timed out". It never
    reaps the process, so the process group _end kills cannot be a stranger's."""
    out, todo = bytearray(), memoryview(data)
    os.set_blocking(proc.stdin.fileno(), False)
    while time.monotonic() < deadline:
        ready, writable, _ = select.select([proc.stdout], [proc.stdin] if todo else [], [],
                                           max(0.0, deadline - time.monotonic()))
        if writable:
            try:
                todo = todo[os.write(proc.stdin.fileno(), todo):]
            except BlockingIOError:
                continue
            except BrokenPipeError:  # the sandbox died before reading it all
                todo = todo[:0]
            if not todo:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        if ready:
            chunk = os.read(proc.stdout.fileno(), min(1 << 16, cap + 1 - len(out)))
            out += chunk
            if len(out) > cap:
                return bytes(out[:cap]), "output limit"
            while not chunk and time.monotonic() < deadline:  # closed: it may still run, and sleep
                if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                    return bytes(out), "done"
                time.sleep(0.01)
    return bytes(out), "timed out"


def _end(proc, cgroups):
    """Kill whatever is left of the sandbox, reap it, remove its cgroups."""
    with contextlib.suppress(ProcessLookupError):  # not reaped yet, so the group is still ours
        os.killpg(proc.pid, signal.SIGKILL)  # --kill-child then takes down the PID namespace
    for folder in cgroups:
        _remove_cgroup(folder)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            pipe.close()
