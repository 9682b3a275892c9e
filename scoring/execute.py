"""Running the model's code in the sandbox (scoring/sandbox.py) for code rewards and tools: a
solution against its tests (run_tests), a program for its output (run_python, the Python tool), and
a task's own scorer that evaluates text the model wrote (Scorer).

Standard library and scoring/sandbox.py only. A value crosses between the processes as JSON of exact
builtin types; anything else stays in the process that made it, as a handle the other side may only
ask about (REMOTE_OPS).
"""

import json
import math
import os
import select
import subprocess
import sys
import time

from scoring.sandbox import MAX_RESULT_BYTES, SandboxError, _end, _exchange, _start, _under

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
    if how == "output limit":  # killed at the byte cap: cut, whatever its length in characters
        text = text[:max_output] + TRUNCATED
    if how == "timed out":  # first, so that no cut of the output hides it
        text = f"[timed out after {timeout:g} s]\n" + text
    return capped(text, max_output), how == "done" and proc.returncode == 0


TRUNCATED = "\n[output truncated]"


def capped(text, chars):
    """A result the model will read, at most `chars` characters and the TRUNCATED marker; cut
    before anything tokenises it, so a tool's 100 MB answer costs nothing to refuse. Cutting twice
    cuts nothing more."""
    return text if len(text) <= chars else text[:chars] + TRUNCATED


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
KEPT = set()  # pids of Scorer processes: they outlive a reward call (runner._end_leftovers spares)


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
        root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the project
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
