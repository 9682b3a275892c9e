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
import json
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


# ---------------------------------------------------------------- running tests of code

# Code values cross between processes as JSON of exact builtin types, tuples, sets and dicts tagged:
# an object whose == lies is never a value. Anything else stays where it was made, as a handle.
PLAIN = r"""
exact = type
def encode(x, keep=None):
    if x is None or exact(x) in (bool, int, float, str): return x
    if exact(x) is list: return [encode(v, keep) for v in x]
    if exact(x) in (tuple, set): return {exact(x).__name__: [encode(v, keep) for v in x]}
    if exact(x) is dict: return {"dict": [[encode(k, keep), encode(v, keep)] for k, v in x.items()]}
    if keep is None: raise TypeError("not a plain value")
    return {"handle": keep(x)}
def decode(x, handle=None):
    if x is None or exact(x) in (bool, int, float, str): return x
    if exact(x) is list: return [decode(v, handle) for v in x]
    [(kind, items)] = x.items()
    if kind == "handle" and handle is not None: return handle(items)
    return {"tuple": tuple, "set": set, "dict": lambda kv: dict((k, v) for k, v in kv)}[kind](
        [decode(v, handle) for v in items])
"""

# Both processes start alike: the job from stdin, their own stdin/stdout/stderr to /dev/null (the
# pipes stay theirs, duplicated), the job's resource limits
JOB = r"""inp, out = os.fdopen(os.dup(0)), os.fdopen(os.dup(1), "w")
job = json.loads(inp.readline())
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0); os.dup2(null, 1); os.dup2(null, 2)
for name, limit in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (limit, limit))
"""

# The solution's process. It runs the model's code, then answers requests, one JSON line each:
# the value of a name, a call, an attribute, an item, the items of an iterable, a {call} test's
# expression. It sees the arguments of the calls (the tests' inputs) and nothing else: no expected
# value, no test's text. A value that is not plain stays here as a handle (a function, a class, a
# generator): the tests' process can call it, take its attributes or items, or list it.
SOLUTION = PLAIN + r"""
import builtins, io, itertools, json, os, resource, sys
""" + JOB + r"""code, handles = job.pop("code"), []
def keep(x):
    handles.append(x); return len(handles) - 1
def run(stdin=""):
    sys.stdin, sys.stdout, scope = io.StringIO(stdin), io.StringIO(), {"__name__": "__main__"}
    try:
        exec(compile(code, "solution.py", "exec"), scope)
    finally:
        printed, sys.stdin, sys.stdout = sys.stdout.getvalue(), sys.__stdin__, sys.__stdout__
    return scope, printed
me = os.getpid()
try:
    scope, loaded = run()[0] if job["load"] else {}, True
except BaseException:
    loaded = False
def answer(req):
    if not loaded: raise ImportError("the code did not run")
    op, ref = req["op"], req.get("ref")
    if op == "name":
        if req["name"] not in scope: raise NameError(req["name"])
        value = scope[req["name"]]
        return {"module": True} if exact(value) is exact(sys) else {"value": encode(value, keep)}
    if op == "program":
        return {"value": run(req["stdin"])[1]}
    if op == "eval":
        return {"value": encode(eval(compile(req["source"], "test", "eval"), scope))}
    if op == "call":
        args = [decode(a, handles.__getitem__) for a in req["args"]]
        kwargs = {k: decode(v, handles.__getitem__) for k, v in req["kwargs"].items()}
        value = handles[ref](*args, **kwargs)
        # what the call did to a list, dict or set it was given goes back (in-place edits)
        back = [encode(a, keep) if exact(a) in (list, dict, set) else None for a in args]
        return {"value": encode(value, keep), "args": back}
    if op == "attr":
        return {"value": encode(getattr(handles[ref], req["name"]), keep)}
    if op == "item":
        return {"value": encode(handles[ref][decode(req["key"], handles.__getitem__)], keep)}
    if op == "iter":
        return {"value": [encode(v, keep) for v in itertools.islice(handles[ref], job["cap"])]}
    if op == "len":
        return {"value": len(handles[ref])}
    raise ValueError(op)
while os.getpid() == me:  # a process the code forked ends here: one process answers
    line = inp.readline()
    if not line: break
    try:
        req = json.loads(line)
        reply = answer(req)
    except BaseException as e:  # only a builtin exception's name leaves: nothing of the code's
        name = exact(e).__name__
        reply = {"raise": name if getattr(builtins, name, None) is exact(e) else "Exception"}
    try:
        text = json.dumps(reply)
    except BaseException:
        text = json.dumps({"raise": "ValueError"})
    if os.getpid() != me: break
    out.write(text + "\n"); out.flush()
os._exit(0)
"""

# The tests' process. Each test (with the setup lines before it) runs here as written, asserts in
# functions and loops too, with the expected values; a name it does not define is the solution's
# (a standard module's name is imported here: math.isclose(f(x), 1.5) never hands 1.5 to the
# solution). A call of the solution's goes out as a request; plain values come back. A handle
# cannot be compared, hashed or tested for truth: only plain values can pass a test.
TESTS = PLAIN + r"""
import builtins, importlib, json, os, resource, sys
""" + JOB + r"""def ask(**req):
    out.write(json.dumps({"ask": req}) + "\n"); out.flush()
    reply = json.loads(inp.readline())
    if "raise" in reply:
        kind = getattr(builtins, reply["raise"], Exception)
        raise kind("raised in the solution") if isinstance(kind, type) else Exception()
    return reply
def local(x):
    return decode(x, Remote)
def sent(x):
    return encode(x, lambda r: r.ref if exact(r) is Remote else refuse(r))
def refuse(*args):
    raise TypeError("only plain values and the solution's own objects go to the solution")
class Remote:
    __slots__ = ("ref",)
    def __init__(self, ref): self.ref = ref
    def __call__(self, *args, **kwargs):
        reply = ask(op="call", ref=self.ref, args=[sent(a) for a in args],
                    kwargs={k: sent(v) for k, v in kwargs.items()})
        for given, back in zip(args, reply["args"]):  # in-place edits of a list, dict or set
            if back is not None and type(given) is type(local(back)):
                new = local(back)
                if type(given) is list: given[:] = new
                else: given.clear(); given.update(new)
        return local(reply["value"])
    def __getattr__(self, name): return local(ask(op="attr", ref=self.ref, name=name)["value"])
    def __getitem__(self, key): return local(ask(op="item", ref=self.ref, key=sent(key))["value"])
    def __iter__(self): return iter([local(v) for v in ask(op="iter", ref=self.ref)["value"]])
    def __len__(self): return ask(op="len", ref=self.ref)["value"]
    def __repr__(self): return "<a value of the solution's>"
    def opaque(self, *args): raise TypeError("a value of the solution's that is not plain")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = opaque
class Names(dict):
    def __missing__(self, name):
        if hasattr(builtins, name): return getattr(builtins, name)
        if name in sys.stdlib_module_names:  # always the real module: never the solution's "math"
            return importlib.import_module(name)
        reply = ask(op="name", name=name)
        if "module" in reply: raise NameError(name)
        return local(reply["value"])
for i, test in enumerate(job["tests"]):
    try:
        names = Names(__name__="__main__")
        exec(compile(job["setup"], "setup", "exec"), names)
        exec(compile(test, f"test_{i}", "exec"), names)
        passed = True
    except BaseException:
        passed = False
    out.write(json.dumps({"test": i, "passed": passed}) + "\n"); out.flush()
"""


def _decode(x):
    """A value from the solution's JSON, of exact builtin types only; raises on anything else."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_decode(v) for v in x]
    [(kind, items)] = x.items()
    return {"tuple": tuple, "set": set, "dict": dict}[kind]([_decode(v) for v in items])


def _as_json(x):
    """A value as a dataset's JSON holds it: tuples as lists; a set or a non-string key fails."""
    if type(x) in (list, tuple):
        return [_as_json(v) for v in x]
    if type(x) is dict and all(type(k) is str for k in x):
        return {k: _as_json(v) for k, v in x.items()}
    if type(x) in (dict, set):
        raise TypeError("not a JSON value")
    return x


class _Line:
    """Reads a process's output a JSON line at a time, under a deadline and a byte cap."""

    def __init__(self, proc, deadline):
        self.proc, self.deadline, self.buffer, self.read = proc, deadline, b"", 0

    def __call__(self):
        """The next line as JSON; None at its end, past the deadline or the cap, or not JSON."""
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or self.read > MAX_RESULT_BYTES:
                return None
            if not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
            self.read += len(chunk)
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except (ValueError, RecursionError):
            return None


def _send(proc, message, deadline):
    """One JSON line to a process's stdin by the deadline; False if it is gone or not reading."""
    todo = memoryview((json.dumps(message) + "\n").encode())
    fd = proc.stdin.fileno()
    os.set_blocking(fd, False)
    while todo:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            return False
        try:
            todo = todo[os.write(fd, todo):]
        except BlockingIOError:
            continue
        except OSError:
            return False
    return True


def run_tests(code, tests, timeout=5.0, memory_mb=512, setup=""):
    """Run `code` against `tests` in the sandbox: per test, passed or not (W1).

    tests: assert tests (strings: statements, asserts in functions and loops too; `setup` runs
    before each), {"call": expression, "expected": value} (the value compared here exactly, as
    JSON holds it), or {"stdin": text, "stdout": text} (a program's printed lines compared here,
    each stripped). The code runs in one sandbox and sees the calls' inputs only; the assert tests
    run in a second one, with the expected values, the code's values reaching them as plain data.
    Nothing of the tests runs outside a sandbox. Past `timeout` every test fails (W1). Raises
    SandboxError where the tier ALLOWED cannot be had.
    """
    strings = [t for t in tests if isinstance(t, str)]
    programs = any(isinstance(t, dict) and "stdin" in t for t in tests)
    deadline, ends = time.monotonic() + timeout, []
    try:
        solution, cgroups, limits = _start(SOLUTION, subprocess.DEVNULL, timeout, memory_mb)
        ends.append((solution, cgroups))
        load = not programs  # a program reads its input when it runs: one run per test
        _send(solution, {"code": code, "load": load, "limits": limits, "cap": 10_000}, deadline)
        answers = _Line(solution, deadline)

        def ask(request):  # the solution's reply to one request, or None
            return answers() if _send(solution, request, deadline) else None

        results = [_own_test(t, ask) if isinstance(t, dict) else None for t in tests]
        if strings:
            checker, cgroups, limits = _start(TESTS, subprocess.DEVNULL, timeout, memory_mb)
            ends.append((checker, cgroups))
            _send(checker, {"tests": strings, "setup": setup, "limits": limits}, deadline)
            verdicts = _relay(checker, ask, deadline)
            where = [i for i, t in enumerate(tests) if isinstance(t, str)]
            for k, i in enumerate(where):
                results[i] = verdicts.get(k, False)
    finally:
        for proc, cgroups in ends:
            _end(proc, cgroups)
    if time.monotonic() > deadline:
        return [False] * len(tests)
    return [bool(r) for r in results]


def _own_test(test, ask):
    """A {call, expected} or {stdin, stdout} test, judged here from the solution's plain reply."""
    if set(test) == {"stdin", "stdout"} and all(type(v) is str for v in test.values()):
        reply = ask({"op": "program", "stdin": test["stdin"]})
        printed = reply.get("value") if isinstance(reply, dict) else None
        return type(printed) is str and _lines(printed) == _lines(test["stdout"])
    if set(test) != {"call", "expected"} or type(test["call"]) is not str:
        return False  # a malformed test fails, as one that raises
    reply = ask({"op": "eval", "source": test["call"]})
    try:
        value = _decode(reply["value"])
        return _as_json(value) == json.loads(json.dumps(test["expected"]))
    except (TypeError, KeyError, ValueError, AttributeError, RecursionError):
        return False


def _lines(text):
    """A program's output as APPS compares it: its lines, each stripped, none blank at the end."""
    return [line.strip() for line in text.strip().splitlines()]


REMOTE_OPS = ("name", "call", "attr", "item", "iter", "len")  # what the tests may ask the solution


def _relay(checker, ask, deadline):
    """Pass the tests' requests to the solution and its replies back: {test index: passed}."""
    verdicts, lines = {}, _Line(checker, deadline)
    while (message := lines()) is not None:
        if type(message) is not dict:
            break
        if "ask" in message:
            request = message["ask"]
            ok = type(request) is dict and request.get("op") in REMOTE_OPS
            reply = ask(request) if ok else None
            if reply is None or not _send(checker, reply, deadline):
                break
        elif type(message.get("test")) is int and type(message.get("passed")) is bool:
            verdicts.setdefault(message["test"], message["passed"])
    return verdicts


# Runs inside the sandbox: the code arrives on stdin; what it prints is the tool's output. An
# exception prints one line (its type and message), not a traceback of the harness.
TOOL_HARNESS = r"""
import json, resource, sys
job = json.loads(sys.stdin.read())
for name, limit in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (limit, limit))
try:
    exec(compile(job["code"], "<python>", "exec"), {"__name__": "__main__"})
except Exception as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(1)
"""


def run_python(code, timeout=5.0, memory_mb=256, max_output=1000):
    """Run a tool call's code in the sandbox: (output, ok).

    output: what it printed (stdout and stderr), at most max_output characters, cut with a marker.
    ok is False when the code raised, was killed (timeout, memory, output past the limit), exited
    non-zero, or the tier ALLOWED cannot be had here (the output says so: the code did not run).
    Output is read as it comes, the sandbox killed past the limit: a flood never fills our memory.
    """
    try:
        proc, cgroups, limits = _start(TOOL_HARNESS, subprocess.STDOUT, timeout, memory_mb)
    except SandboxError as e:
        return f"error: {e}", False
    try:
        job = json.dumps({"code": code, "limits": limits}).encode()
        cap = 4 * max_output  # bytes: a character is at most 4
        out, how = _exchange(proc, job, time.monotonic() + timeout, cap)
    finally:
        _end(proc, cgroups)
    text = out.decode(errors="replace")
    if len(text) > max_output or how == "output limit":
        text = text[:max_output] + "\n[output truncated]"
    if how == "timed out":
        text += f"\n[timed out after {timeout:g} s]"
    return text, how == "done" and proc.returncode == 0


# ---------------------------------------------------------------- a task's scorer that runs text

# Runs in each call's child of a Scorer: what Python may be compiled from text while a call runs.
# A library scorer may eval() an answer or hand it to sympy's parse_expr (which evals its own
# translation of it): the text may be literals, arithmetic, comparisons and calls of sympy's
# functions by name, no more. No attribute, subscript, lambda or comprehension, and no name but
# sympy's (and in parse_expr the sympy symbols the scorer gave it): so no __import__, no
# globals(), and none of the scorer's own names (the gold answer).
# A module's source compiled on import, and sympy's own `from sympy import *`, pass. Processes,
# sockets and ctypes are refused too, in case something runs after all (the sandbox holds anyway).
GUARD = r"""
import ast, os, sys
ALLOWED = (ast.Module, ast.Expression, ast.Expr, ast.Constant, ast.Name, ast.Load, ast.Call,
           ast.keyword, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Tuple, ast.List,
           ast.Set, ast.Dict, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)
REFUSED = ("subprocess.", "socket.", "ctypes.", "os.system", "os.exec", "os.posix_spawn",
           "os.spawn", "os.fork", "os.kill", "os.killpg", "pty.", "os.putenv", "os.chmod")
# sympy's parse_expr evaluates in the namespaces the scorer gave it, not in the scorer's frame:
# there a name may also be one of those, bound to a sympy object (a Symbol of the task's)
def given(caller):
    if caller.f_code.co_name != "eval_expr" or "sympy" not in caller.f_code.co_filename:
        return set()
    import sympy
    spaces = [caller.f_locals.get("local_dict") or {}, caller.f_locals.get("global_dict") or {}]
    return {k for space in spaces for k, v in space.items()
            if isinstance(v, sympy.Basic) or isinstance(v, type) and issubclass(v, sympy.Basic)}
def harmless(tree, names):
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in names: return False
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name): return False
        if not isinstance(node, ALLOWED): return False
    return True
checking = []  # ast.parse compiles too: its own event passes
def guard(event, args):
    if event == "compile" and not checking:
        source, filename = args[0], args[1]
        if isinstance(filename, str) and filename.endswith(".py") and os.path.isfile(filename):
            return  # a module's own source, compiled on its import
        if isinstance(source, bytes): source = source.decode("utf-8", "replace")
        if isinstance(source, str) and source.strip() == "from sympy import *": return
        checking.append(1)
        try:
            tree = source if isinstance(source, ast.AST) else ast.parse(source)
        except BaseException:
            tree = None
        finally:
            checking.clear()
        if tree is None or not harmless(tree, NAMES | given(sys._getframe(1))):
            raise RuntimeError("refused: text compiled while scoring may only be literals, "
                               "arithmetic and sympy's functions")
    elif event.startswith(REFUSED):
        raise RuntimeError(f"refused while scoring: {event}")
"""

# The long-lived process of a Scorer: it imports the task file once (with the installed packages in
# view), then runs each call in a child it forks, under GUARD, with the call's deadline: no call
# can change what the next one sees (each child dies), and a hang or a crash costs one call.
SCORER = GUARD + r"""
import importlib.util, json, resource, select, signal, time
inp, out = os.fdopen(os.dup(0)), os.fdopen(os.dup(1), "w")
job = json.loads(inp.readline())
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0); os.dup2(null, 1); os.dup2(null, 2)
for name, limit in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (limit, limit))
sys.path[:] = job["sys_path"]
spec = importlib.util.spec_from_file_location(job["module"], job["file"])
module = importlib.util.module_from_spec(spec)
sys.modules[job["module"]] = module
spec.loader.exec_module(module)
if job["config"] is not None and hasattr(module, "configure"):
    import config
    cfg = config.Config()
    def as_tuple(value):  # JSON gave lists where the Config holds tuples
        return tuple(value) if isinstance(value, list) else value

    for key, value in job["config"].items():
        if key == "task_options":
            value = {k: as_tuple(v) for k, v in value.items()}
        setattr(cfg, key, as_tuple(value))
    module.configure(config.derive(cfg))
function = getattr(module, job["function"])
try:
    import sympy
    NAMES = {n for n in dir(sympy) if not n.startswith("_") and callable(getattr(sympy, n))}
    NAMES |= {n for n in ("pi", "E", "I", "oo", "zoo", "nan") if hasattr(sympy, n)}
except ImportError:
    NAMES = set()
NAMES = (NAMES | {"True", "False", "None"}) - set(job["refused_names"])
def call(args, kwargs, seconds):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.closerange(3, write); os.closerange(write + 1, 1 << 16)
            resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))
            sys.addaudithook(guard)
            try:
                reply = {"value": function(*args, **kwargs)}
            except BaseException as e:
                reply = {"error": f"{type(e).__name__}: {e}"[:500]}
            text = json.dumps(reply)
        except BaseException:
            text = json.dumps({"error": "its value is not JSON"})
        os.write(write, text.encode()); os._exit(0)
    os.close(write)
    got, deadline = b"", time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or len(got) > 1 << 20 or not select.select([read], [], [], left)[0]: break
        chunk = os.read(read, 1 << 16)
        if not chunk: break
        got += chunk
    os.close(read)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    try:
        return json.loads(got)
    except ValueError:
        return {"error": f"no result within {seconds} s" if time.monotonic() >= deadline else
                "its process died"}
for line in inp:
    request = json.loads(line)
    reply = call(request["args"], request["kwargs"], request["seconds"])
    out.write(json.dumps(reply) + "\n"); out.flush()
"""
# sympy's names that reach the system or turn more text into code: never in text a scorer compiles
REFUSED_NAMES = ("sympify", "S", "parse_expr", "lambdify", "preview", "plot", "plot_implicit",
                 "plot_parametric", "plot3d", "plot3d_parametric_line", "plot3d_parametric_surface",
                 "init_printing", "init_session", "var", "test", "doctest", "source",
                 "interactive_traversal", "python", "pycode", "print_python", "evaluate")
KEPT = set()  # pids of Scorer processes: they outlive a reward call (scoring._end_leftovers spares)


class Scorer:
    """A function of a task file that may execute the answer's text (a library's scorer; the task
    declares EXECUTES_TEXT), called as it would be, but run in the sandbox: a process there imports
    the file once, with the installed packages and the source files of the modules loaded here in
    view (no data, no other file of the project), and runs each call in a child of its own under
    GUARD, within `timeout` seconds. Arguments and the value go across as JSON. Started on the first
    call in each process (a reward worker forks before it), ended with that process."""

    def __init__(self, path, module, function, timeout, config=None, memory_mb=4096):
        self.path, self.module, self.function = os.path.realpath(path), module, function
        self.timeout, self.config, self.memory_mb = timeout, config, memory_mb
        self.proc = self.owner = None

    def _shown(self):
        """The host paths the sandbox needs: every *-packages folder on sys.path, and the source
        file of every module loaded here from outside them (the project's, the task file's)."""
        packages = {os.path.realpath(p) for p in sys.path if p.endswith("-packages")}
        files = {os.path.realpath(m.__file__) for m in list(sys.modules.values())
                 if getattr(m, "__file__", None) and m.__file__.endswith(".py")}
        files = {f for f in files if not any(_under(f, p) for p in packages)}
        return tuple(sorted(p for p in {*packages, *files, self.path} if os.path.exists(p)))

    def _start(self):
        if self.proc is not None and self.owner == os.getpid() and self.proc.poll() is None:
            return
        self.proc, cgroups, limits = _start(SCORER, subprocess.DEVNULL, None, self.memory_mb,
                                            self._shown())
        self.owner, self.cgroups = os.getpid(), cgroups
        KEPT.add(self.proc.pid)
        root = os.path.dirname(os.path.realpath(__file__))  # the project (a link resolved)
        sys_path = [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
        job = {"file": self.path, "module": self.module, "function": self.function,
               "limits": limits, "sys_path": [root, *sys_path],
               "config": self.config, "refused_names": REFUSED_NAMES}
        if not _send(self.proc, job, time.monotonic() + 30):
            self.close()
            raise SandboxError("the scorer's sandbox did not start")

    def __call__(self, *args, **kwargs):
        self._start()
        seconds = max(1, math.ceil(self.timeout))
        # its first call also waits for the task file's import (reasoning-gym: ~2 s)
        deadline = time.monotonic() + seconds + 60
        request = {"args": list(args), "kwargs": kwargs, "seconds": seconds}
        if not _send(self.proc, request, deadline):
            self.close()
            raise RuntimeError("the scorer's sandbox is gone")
        reply = _Line(self.proc, deadline)()
        if not isinstance(reply, dict) or "value" not in reply:
            if reply is None:
                self.close()  # a dead or stuck server: the next call starts a fresh one
            raise RuntimeError(f"in the sandbox: {(reply or {}).get('error', 'no reply')}")
        return reply["value"]

    def close(self):
        if self.proc is not None and self.owner == os.getpid():
            KEPT.discard(self.proc.pid)
            _end(self.proc, self.cgroups)
        self.proc = None
