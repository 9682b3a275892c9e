"""The sandbox: what model code reaches; nothing outlives a call.   pytest tests/test_sandbox.py

The tests of the full sandbox run where it can be built (Linux, as root or with unprivileged user
namespaces) and are skipped elsewhere; the fail-closed tests simulate a machine where it cannot be.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from config import ConfigError, load_config
from episodes.task import load_problems, load_task
from rewards import code_reward
from run.audit import check_sandbox
from scoring import execute, sandbox
from scoring.runner import run_rewards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIER, WHY = sandbox.best()
NO_FULL = f"the full sandbox cannot be built here: {WHY}"
full_sandbox = pytest.mark.skipif(TIER != "full", reason=NO_FULL)


def C(code):
    return f"<think>k</think><answer>```python\n{code}\n```</answer>"


def below(pid):
    """The live processes below `pid`."""
    children = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def alive(pids):
    """The pids in `pids` that are still running (not gone, not zombies)."""
    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    return [p for p in pids if running(p)]


def uid(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def with_marker(marker):
    """The pids of processes whose command line holds `marker`."""
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(name))
        except OSError:
            pass
    return alive(pids)


# ---------------------------------------------------------------- closed in every install


PROBE = """
import json, os, socket, sys
sys.path.insert(0, {root!r})
from scoring import execute, sandbox
inside = '''
import json, os, socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
    network = "connected"
except OSError:
    network = "blocked"
packages = [d for d, _, _ in os.walk("/") if d.endswith("-packages") and os.listdir(d)
            and not d.startswith(("/proc", "/dev"))]
print(json.dumps({{"uid": os.getuid(), "network": network, "project": os.path.exists({root!r}),
                  "secret": os.path.exists({secret!r}), "passwd": os.path.exists("/etc/passwd"),
                  "packages": packages}}))
'''
out, ok = execute.run_python(inside, timeout=30, max_output=10000)
print(json.dumps({{"best": sandbox.best(), "out": out, "ok": ok}}))
"""


def make_python(kind, tmp_path):
    """This Python, its venv under /tmp, that venv through a symlink, or a venv of the system's."""
    if kind == "this":
        return sys.executable
    base = "/usr/bin/python3" if kind == "system venv" else sys.executable
    if not os.path.exists(base):
        pytest.skip(f"no {base}")
    subprocess.run([base, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    if kind == "symlinked venv":
        os.symlink(tmp_path / "venv", tmp_path / "link")
        return str(tmp_path / "link" / "bin" / "python")
    return str(tmp_path / "venv" / "bin" / "python")


@full_sandbox
@pytest.mark.parametrize("kind", ["this", "venv", "symlinked venv", "system venv"])
def test_every_install_gets_the_full_sandbox(kind, tmp_path):
    """A venv under /tmp (the file view used to mount over it), reached through a symlink, or of
    the system's Python (dist-packages in /usr): the code gets no network, file of ours, package."""
    assert str(tmp_path).startswith("/tmp/")
    python = make_python(kind, tmp_path)
    secret = tmp_path / "answers.json"
    secret.write_text("{}")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    script = PROBE.format(root=ROOT, port=server.getsockname()[1], secret=str(secret))
    try:
        got = json.loads(subprocess.run([python, "-c", script], capture_output=True, timeout=120,
                                        cwd=tmp_path).stdout)
    finally:
        server.close()
    assert got["best"] == ["full", ""] and got["ok"], got
    inside = json.loads(got["out"])
    assert inside["uid"] >= sandbox.UID_BASE and inside["network"] == "blocked"
    assert not inside["project"] and not inside["secret"] and not inside["passwd"]
    assert inside["packages"] == []  # every *-packages folder is empty: nothing to sys.path.append


@pytest.fixture
def no_unshare(monkeypatch, tmp_path):
    """A machine without util-linux's unshare (a container, macOS): probed with none on PATH."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sandbox, "_BEST", None)
    monkeypatch.setattr(sandbox, "ALLOWED", "full")
    missing = "util-linux's unshare is not installed"
    assert sandbox.best() == ("none", f"the full sandbox failed: {missing}; "
                                      f"the namespaces sandbox failed: {missing}")


def code_task(*overrides):
    cfg = load_config(overrides=["--task=code", *overrides])
    task = load_task(cfg)
    return cfg, task, load_problems(cfg, task, "train")


def test_without_the_full_sandbox_a_code_run_does_not_start(no_unshare, capsys):
    cfg, task, problems = code_task()
    refused = ("code.py runs the model's code, but the full sandbox cannot be built here: the "
               "full sandbox failed: util-linux's unshare is not installed.*--sandbox=none \\(no")
    with pytest.raises(ConfigError, match=refused):
        check_sandbox(cfg, task, problems)
    cfg = load_config(overrides=["--task=countdown", "--tools=true"])
    with pytest.raises(ConfigError, match="tools=True runs the model's code"):
        check_sandbox(cfg, load_task(cfg), [])
    cfg = load_config(overrides=["--task=countdown"])  # no code runs: nothing to refuse
    check_sandbox(cfg, load_task(cfg), [])
    cfg, task, problems = code_task("--sandbox=none")  # accepted by name: allowed, and said
    check_sandbox(cfg, task, problems)
    out = capsys.readouterr().out
    assert "sandbox=none: " in out and "runs the model's code in the none sandbox (no isol" in out
    assert sandbox.ALLOWED == "none" and execute.run_python("print(6 * 7)") == ("42\n", True)


def test_a_namespaces_only_machine_runs_with_sandbox_namespaces_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "_BEST", ("namespaces", "the full sandbox failed: mount: denied"))
    monkeypatch.setattr(sandbox, "ALLOWED", "full")
    cfg, task, problems = code_task()
    with pytest.raises(ConfigError, match="mount: denied.*--sandbox=namespaces \\(no network, but"):
        check_sandbox(cfg, task, problems)
    cfg, task, problems = code_task("--sandbox=namespaces")
    check_sandbox(cfg, task, problems)
    assert sandbox.ALLOWED == "namespaces"
    out = capsys.readouterr().out
    assert "sandbox=namespaces: " in out and "mount: denied" in out
    assert "code.py runs the model's code in the namespaces sandbox" in out


def test_a_dataset_needs_the_sandbox_only_for_its_code_rows(no_unshare, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    cfg = load_config(overrides=[f"--task={rows}"])
    check_sandbox(cfg, load_task(cfg), [{"prompt": "1 + 1?", "answer": "2"}])  # math: runs anywhere
    with pytest.raises(ConfigError, match="tasks/dataset.py runs the model's code"):
        check_sandbox(cfg, load_task(cfg), [{"prompt": "add", "tests": ["assert add(1, 2) == 3"]}])


def test_a_task_whose_reward_executes_text_needs_the_sandbox(no_unshare):
    """EXECUTES_TEXT (reasoning-gym's scorers) fails closed like code: no sandbox, no run."""
    cfg = load_config(overrides=["--task=reasoning_gym", "--rg_dataset=countdown"])
    with pytest.raises(ConfigError, match="may run the model's text as code .EXECUTES_TEXT."):
        check_sandbox(cfg, load_task(cfg), [{"id": "x"}])


# the text guard in a process of its own (an audit hook stays for good): each source -> compiled?
GUARD_CHECK = execute.GUARD + r"""
import json, sympy
from sympy.parsing.sympy_parser import parse_expr
NAMES = ({n for n in dir(sympy) if not n.startswith("_") and callable(getattr(sympy, n))}
         | {"True", "False", "None"}) - set(json.loads(sys.argv[1]))
sys.addaudithook(guard)
oracle_answer = "the gold"
def evaluated(text, how):
    try:
        given = {"X": sympy.Symbol("X")}
        value = eval(text) if how == "eval" else parse_expr(text, local_dict=given)
        return str(value)
    except Exception as e:
        return "refused" if "refused" in str(e) else type(e).__name__
cases = json.loads(sys.stdin.read())
print(json.dumps([evaluated(text, how) for text, how in cases]))
"""


def test_the_text_guard_compiles_literals_arithmetic_and_sympy_only():
    """What a library scorer may compile from an answer: literals and arithmetic (eval), sympy's
    translation of an expression over its functions and the symbols the scorer gave it (parse_expr);
    never a name of the scorer's frame, an attribute, a call of anything else, a lambda."""
    cases = [("['A', 'B']", "eval"), ("[[1, 2], [3, 4]]", "eval"), ("3 + 4 * 5", "eval"),
             ("(99 - 3) / 4", "parse"), ("X**2/2 + C", "parse"), ("sin(X) + pi", "parse"),
             ("oracle_answer", "eval"), ("globals()", "eval"), ("__import__('os')", "eval"),
             ("__import__('os').getcwd()", "parse"), ("(lambda: 1)()", "parse"),
             ("[x for x in (1, 2)]", "eval"), ("sympify('1+1')", "parse"), ("().__class__", "eval")]
    proc = subprocess.run([sys.executable, "-c", GUARD_CHECK, json.dumps(execute.REFUSED_NAMES)],
                          input=json.dumps(cases), capture_output=True, text=True, timeout=120)
    got = dict(zip([t for t, _ in cases], json.loads(proc.stdout)))
    assert got["['A', 'B']"] == "['A', 'B']" and got["3 + 4 * 5"] == "23"
    assert got["(99 - 3) / 4"] == "24" and got["X**2/2 + C"] == "C + X**2/2"
    assert got["sin(X) + pi"] == "sin(X) + pi"
    refused = ["oracle_answer", "globals()", "__import__('os')", "__import__('os').getcwd()",
               "(lambda: 1)()", "[x for x in (1, 2)]", "sympify('1+1')", "().__class__"]
    assert {t: got[t] for t in refused} == {t: "refused" for t in refused}


def test_grpo_stops_before_any_model_without_the_sandbox(no_unshare, tmp_path):
    import grpo

    with pytest.raises(ConfigError, match="cannot be built here"):
        grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), f"--out_dir={tmp_path}/run",
                   "--task=code"])
    assert not os.path.exists(tmp_path / "run")


def test_a_call_below_the_allowed_tier_never_runs_the_code(no_unshare, tmp_path):
    marker = tmp_path / "ran"
    out, ok = execute.run_python(f"open({str(marker)!r}, 'w').write('x')")
    assert not ok and out.startswith("error: the full sandbox cannot be built here")
    assert "sandbox=none" in out
    code = C(f"open({str(marker)!r}, 'w').write('x')\ndef f(): return 1")
    with pytest.raises(sandbox.SandboxError, match="cannot be built here"):
        code_reward(code, ["assert f() == 1"])
    assert not marker.exists()
    reward = lambda text, problem: code_reward(text, problem["tests"])  # noqa: E731
    # in a run, the reward fails: the completion scores 0 and is counted in reward/errors
    assert run_rewards(reward, [code], [{"tests": ["assert f() == 1"]}], 0, quiet=True) == ["error"]
    assert not marker.exists()


# ---------------------------------------------------------------- the hidden tests stay hidden


# finds "secret(1)" ... 7193 wherever the tests are in this process: frames, objects, stdin
LOOKUP = r'''
import gc, re, sys
def _texts():
    frame = sys._getframe()
    while frame:
        yield repr(frame.f_globals)
        yield repr(frame.f_locals)
        frame = frame.f_back
    for o in gc.get_objects():
        if isinstance(o, (dict, list)) and "secret(" in repr(o)[:100000]:
            yield repr(o)
    for read in (lambda: open("/proc/self/fd/0").read(), sys.stdin.read, sys.__stdin__.read):
        try:
            yield read()
        except Exception:
            pass
def secret(x):
    for text in _texts():
        m = re.search(r"secret\(%d\)\D{1,40}?(\d{4,})" % x, text)
        if m:
            return int(m.group(1))
'''
SECRET_TESTS = [{"call": "secret(1)", "expected": 7193}, "assert secret(2) == 4817",
                "y = 3\nassert secret(3) == 9120"]


def test_a_lookup_table_of_the_hidden_tests_finds_nothing():
    assert code_reward(C(LOOKUP), SECRET_TESTS)["correct"] == 0.0
    honest = "def secret(x):\n    return {1: 7193, 2: 4817, 3: 9120}[x]"  # the tests do run
    assert code_reward(C(honest), SECRET_TESTS)["correct"] == 1.0


def test_forged_result_lines_score_nothing():
    # lines of every format a harness might read, on every descriptor, first and last, with the
    # nonce an older harness used: they only choose the code's outputs, which are then judged
    forge = textwrap.dedent('''
        import atexit, json, os, sys
        job = sys._getframe(1).f_globals.get("job", {})
        lines = []
        for i in range(3):
            lines += [[job.get("nonce"), i, True, None], [i, [True]], [i, [None]], [i, []]]
        def forge():
            for fd in range(3, 12):
                for line in lines:
                    try:
                        os.write(fd, (json.dumps(line) + "\\n").encode())
                    except OSError:
                        pass
        forge()
        atexit.register(forge)
        def secret(x):
            return -1
    ''')
    assert code_reward(C(forge), SECRET_TESTS)["correct"] == 0.0


# Every assert shape of MBPP, HumanEval and APPS: (tests, setup, an honest solution). The expected
# values are 4-digit numbers the solution cannot guess; square(x) = x * x + 7000.
SHAPES = {
    # MBPP: a module the test uses but does not import (its test_imports are the setup)
    "mbpp import": (["assert math.isclose(square(3), 7009.0)"], "",
                    "def square(x): return x*x + 7000"),
    "mbpp test_imports": (["assert math.isclose(square(3), 7009.0)"], "import math",
                          "def square(x): return x*x + 7000"),
    # the expected value in a setup line, then compared
    "setup line": (["expected = [7004, 7001]\nassert squares([2, 1]) == expected"], "",
                   "def squares(xs): return [x*x + 7000 for x in xs]"),
    # HumanEval: asserts in a function, called on the entry point; and in a loop
    "humaneval": (["def check(candidate):\n    assert candidate(2) == 7004\n"
                   "    assert candidate(3) == 7009\ncheck(square)"], "",
                  "def square(x): return x*x + 7000"),
    "loop": (["for x, y in [(2, 7004), (5, 7025)]:\n    assert square(x) == y"], "",
             "def square(x): return x*x + 7000"),
    # truth and its negation
    "not": (["assert big(7500)", "assert not big(6500)"], "", "def big(x): return x > 7000"),
    # a call test (exact) and a program's output (APPS)
    "call": ([{"call": "square(4)", "expected": 7016}], "", "def square(x): return x*x + 7000"),
    "apps": ([{"stdin": "4\n", "stdout": "7016\n"}], "", "print(int(input()) ** 2 + 7000)"),
}

# a solution that solves nothing and reaches for the tests by every road it has: the tests' text
# and values in its frames, objects and stdin (the expected value after "f(args) ==", in a setup
# line, in a loop's cases; whether a call is negated), a fake `math`, an object equal to anything
CHEAT = r"""
import ast, gc, re, sys
class Yes:
    def __eq__(self, other): return True
    def __bool__(self): return True
    def __hash__(self): return 0
class FakeMath:
    def isclose(self, *args, **kwargs): return True
math = FakeMath()
def texts():
    frame, out = sys._getframe(), []
    while frame:
        out += [repr(frame.f_locals), repr(frame.f_globals)]
        frame = frame.f_back
    return out + [repr(o) for o in gc.get_objects() if isinstance(o, (str, dict, list))]
def guess(*args):
    shown = ", ".join(map(repr, args))
    patterns = [r"\(" + re.escape(shown) + r"\)\s*==\s*([^\s\\]+)",  # f(2) == 7004
                r"\(" + re.escape(shown) + r",\s*(\d+)\)",  # for x, y in [(2, 7004)]
                r"expected\s*=\s*(\[[^\]]*\])"]  # a setup line
    for text in texts():
        if re.search(r"not \w+\(" + re.escape(shown) + r"\)", text): return False
        for pattern in patterns:
            for found in re.findall(pattern, text):
                try: return ast.literal_eval(found)
                except Exception: pass
    return Yes()
square = squares = big = guess
"""


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_assert_shape_hides_its_expected_values(shape, tmp_path):
    """Each shape of MBPP, HumanEval and APPS tests: the honest solution passes, one that solves
    nothing scores 0 whatever it reads or returns (the old split harness gave it 1.0 on four of
    these shapes and 0.5 on "not"), and nothing of the tests runs outside a sandbox (a test that
    writes a file leaves none here)."""
    tests, setup, honest = SHAPES[shape]
    assert code_reward(C(honest), tests, setup=setup)["correct"] == 1.0
    assert code_reward(C(CHEAT), tests, setup=setup)["correct"] == 0.0
    marker = tmp_path / "ran_outside"
    planted = f"open({str(marker)!r}, 'w').write('x')\n"
    if isinstance(tests[0], str):  # a test's own statements, the setup's too, run sandboxed
        code_reward(C(honest), [planted + tests[0]], setup=planted + setup)
        code_reward(C(honest), [f"assert {planted.strip()} == 1"])
    else:
        code_reward(C(honest), [{"call": planted.strip(), "expected": 1}])
    assert not marker.exists()


def test_mbpp_and_humaneval_rows_run_as_their_own_harnesses_run_them():
    """An MBPP row: its test_imports and test_setup_code before each test (math.isclose with no
    import of the test's own); a HumanEval row: its test, then check(entry_point). The reference
    passes, the cheat scores 0."""
    from episodes.task import import_file

    code_task = import_file(os.path.join(ROOT, "tasks", "code.py"))
    mbpp = {"prompt": "Write square.", "tests": ["assert math.isclose(square(3), 7009.0)",
                                                 "assert square(base) == 7016"],
            "test_imports": ["import math"], "test_setup_code": "base = 4",
            "code": "def square(x): return x*x + 7000"}
    humaneval = {"prompt": "def square(x):\n", "canonical_solution": "    return x*x + 7000\n",
                 "entry_point": "square", "test": "METADATA = {}\n\ndef check(candidate):\n"
                 "    assert candidate(2) == 7004\n    assert candidate(3) == 7009\n"}
    for row in (mbpp, humaneval):
        code_task.check(row)
        assert code_task.reward(code_task.reference(row), row)["correct"] == 1.0
        assert code_task.reward(C(CHEAT), row)["correct"] == 0.0
    with pytest.raises(ValueError, match="test_imports"):
        code_task.check({**mbpp, "test_imports": "import math"})


def test_a_value_of_the_solutions_that_is_not_plain_passes_nothing():
    """Only plain values are compared: a generator, a class instance or a function cannot stand
    for a list or a number; the tests may still call, list, index and take attributes of them."""
    code = textwrap.dedent("""
        class Box:
            def __init__(self, v): self.v = v
            def get(self): return self.v
        def gen(n): return (i for i in range(n))
        def box(v): return Box(v)
        def shuffle(xs): xs.reverse()
    """)
    passing = ["assert list(gen(3)) == [0, 1, 2]", "assert box(5).v == 5 and box(6).get() == 6",
               "assert 2 in gen(3)", "xs = [1, 2]\nshuffle(xs)\nassert xs == [2, 1]",
               "b = box(1)\nassert b.get() + 1 == 2"]
    failing = ["assert gen(3) == [0, 1, 2]", "assert box(5) == 5", "assert box(5)",
               "assert {box(1): 1}", "assert box(1) < 2"]
    assert execute.run_tests(code, passing) == [True] * len(passing)
    assert execute.run_tests(code, failing) == [False] * len(failing)


def test_honest_solutions_pass_assert_and_call_tests():
    code = textwrap.dedent("""
        def half(x):
            return x / 2
        def odd(n):
            return n % 2 == 1
        def pair(n):
            return (1, n)
        def listed(n):
            return [1, n]
        def total(xs):
            return sum(xs)
        def gen(n):
            return (i * i for i in range(n))
    """)
    passing = ["assert abs(half(3) - 1.5) < 1e-9", "assert odd(3)", "assert not odd(4)",
               "assert pair(2) == (1, 2)", "assert listed(2) == [1, 2]",
               "xs = [1, 2, 3]\nys = xs + [4]\nassert total(xs) == 6\nassert total(ys) == 10",
               "import math\nassert math.isclose(half(1), 0.5) and type(pair(1)) is tuple",
               "xs = [2, 4]\nassert list(gen(3)) == [0, 1, 4] and sum(map(half, xs)) == 3",
               "assert all(odd(2 * i + 1) for i in range(5))",
               "assert sorted(listed(0), key=lambda t: -t) == [1, 0]",
               {"call": "pair(2)", "expected": [1, 2]}, {"call": "listed(2)", "expected": [1, 2]},
               {"call": "total([])", "expected": 0}]
    assert code_reward(C(code), passing)["correct"] == 1.0
    failing = ["assert pair(2) == [1, 2]", "assert listed(2) == (1, 2)", "assert odd(4)",
               "assert not odd(3)", "assert abs(half(3) - 1.4) < 1e-9", "assert gen(2) == [0, 1]",
               {"call": "half(2)", "expected": 1.5}, {"call": "gen(2)", "expected": [0, 1]},
               "assert total(None) == 0", "assert half(2) ==",
               "xs = undefined\nassert total([]) == 0"]
    assert code_reward(C(code), failing)["correct"] == 0.0


# ---------------------------------------------------------------- limits per sandbox, bounded waits


@full_sandbox
@pytest.mark.skipif("memory" not in sandbox._cgroup_bases(), reason="no memory cgroup (not root?)")
def test_memory_is_bounded_for_the_whole_sandbox():
    """Six children of 100 MB each, under memory_mb=256: at most two can hold theirs at once."""
    code = textwrap.dedent("""
        import os, time
        pids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                try:
                    held = b"x" * (100 << 20)
                except MemoryError:
                    os._exit(1)
                time.sleep(4)
                os._exit(0)
            pids.append(pid)
        time.sleep(2.5)
        print("holding", sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids))
    """)
    out, ok = execute.run_python(code, timeout=10, memory_mb=256)
    assert ok and out.startswith("holding ") and int(out.split()[1]) <= 2, out


@full_sandbox
def test_a_flood_on_the_result_pipe_is_read_only_to_its_cap():
    """The code writes 600 MB where the harness writes its replies (every descriptor it may have):
    the caller reads 1 MB of it, and the test fails."""
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {ROOT!r})
        from scoring import execute
        flood = ("import os\\nfor _ in range(600):\\n    for fd in (3, 4, 5):\\n"
                 "        try: os.write(fd, b'x' * (1 << 20))\\n        except OSError: pass\\n")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        got = execute.run_tests(flood + "def f(): return 1", [{{"call": "f()", "expected": 1}}],
                                timeout=30)
        print(got, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120).stdout.split()
    assert out[0] == "[False]" and int(out[1]) < 50_000, out  # kB: the peak grew by less than 50 MB


@full_sandbox
def test_a_fork_bomb_does_not_starve_another_sandbox():
    bomb = textwrap.dedent("""
        import os, time
        for _ in range(300):
            try:
                if os.fork() == 0:
                    time.sleep(8)
                    os._exit(0)
            except OSError:
                break
        time.sleep(8)
    """)
    done = []
    first = threading.Thread(target=lambda: done.append(execute.run_python(bomb, timeout=6)))
    first.start()
    time.sleep(2)  # the bomb holds all the processes its limit allows
    try:
        forks = "import os\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n" \
                "        os._exit(0)\n    os.waitpid(pid, 0)\nprint('forked 4')"
        assert execute.run_python(forks) == ("forked 4\n", True)
    finally:
        first.join()
    assert done and not done[0][1]


@pytest.mark.parametrize("tier", ["full", "none"])
def test_a_tool_call_that_closes_its_output_still_meets_its_deadline(tier, monkeypatch):
    if TIER != "full" and tier == "full":
        pytest.skip(f"the full sandbox cannot be built here: {WHY}")
    if tier == "none":  # a plain child process: its end of output comes before its exit
        monkeypatch.setattr(sandbox, "_BEST", ("none", "simulated"))
        monkeypatch.setattr(sandbox, "ALLOWED", "none")
    start = time.monotonic()
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)"
    out, ok = execute.run_python(code, timeout=2)
    assert not ok and "[timed out after 2 s]" in out and time.monotonic() - start < 5


SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
host = libc.shmget({key}, 0, 0)  # the host's segment, by its key
mine = libc.shmget(0, 8 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600: a segment of its own, kept
open("/run/lock/left-behind", "w").write("x") if __import__("os").path.isdir("/run/lock") else None
print(host, mine >= 0)
"""


def shm_ids():
    """The SysV shared memory segments this host's IPC namespace holds."""
    with open("/proc/sysvipc/shm") as f:
        return {line.split()[1] for line in f.readlines()[1:]}


@pytest.mark.parametrize("tier", ["full", "namespaces"])
def test_sandboxed_code_has_its_own_sysv_ipc_and_writable_folders(tier, monkeypatch):
    """SysV shared memory is per IPC namespace: the code cannot open the host's segment, and the
    one it leaves dies with its sandbox (before, 6 calls left 1.2 GB resident); what it writes in
    /run/lock stays in its own."""
    if TIER != "full":
        pytest.skip(NO_FULL)
    if tier == "namespaces":
        monkeypatch.setattr(sandbox, "_BEST", ("namespaces", "simulated"))
        monkeypatch.setattr(sandbox, "ALLOWED", "namespaces")
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x6772706F  # "grpo"
    host = libc.shmget(key, 4096, 0o1600)
    assert host >= 0
    before = shm_ids()
    try:
        out, ok = execute.run_python(SHM.format(key=key))
        assert ok and out.split() == ["-1", "True"], out
        assert shm_ids() == before  # its segment went with it
        assert not os.path.exists("/run/lock/left-behind")
    finally:
        libc.shmctl(host, 0, None)  # IPC_RMID


# ---------------------------------------------------------------- no process outlives the run


def spawning_reward(text, problem):
    """A reward that leaves a sleeping child, or a daemon (setsid, double fork); or it hangs."""
    if text in ("child", "hang"):
        subprocess.Popen(["sleep", problem["marker"]])
    if text in ("daemon", "hang"):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", problem["marker"]])
            os._exit(0)
        os.waitpid(pid, 0)
    if text == "hang":
        time.sleep(60)
    return 1.0


def test_processes_a_reward_starts_end_with_its_call():
    marker = f"1000.{os.getpid()}{int(time.time() * 1000) % 100000}"
    try:
        texts = ["child", "daemon", "plain", "hang", "child"]
        problems = [{"marker": marker}] * 5
        got = run_rewards(spawning_reward, texts, problems, timeout=2.0, workers=2, quiet=True)
        assert got == [{"score": 1.0}] * 3 + ["timeout", {"score": 1.0}]
        assert with_marker(marker) == []  # no child, no daemon, nothing the hung reward started
    finally:
        for pid in with_marker(marker):
            os.kill(pid, signal.SIGKILL)


def test_kill_9_of_the_trainer_ends_its_reward_workers(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from scoring.runner import run_rewards
        def reward(text, problem):
            open(os.path.join({str(tmp_path)!r}, str(os.getpid())), "w").close()
            time.sleep(60)
            return 1.0
        run_rewards(reward, ["a", "b"], [{{}}] * 2, timeout=100, workers=2)
    """)
    trainer, workers = subprocess.Popen([sys.executable, "-c", script]), []
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(name) for name in os.listdir(tmp_path)]
        assert len(workers) == 2 and alive(workers) == workers
        trainer.kill()
        deadline = time.monotonic() + 5
        while alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(workers) == []
    finally:
        trainer.kill()
        trainer.wait()
        for pid in alive(workers):
            os.kill(pid, signal.SIGKILL)


@full_sandbox
@pytest.mark.parametrize("call", [
    "run_python('import time; time.sleep(60)', timeout=100)",
    "run_tests('import time\\ntime.sleep(60)', ['assert f() == 1'], timeout=100)"])
def test_kill_9_of_a_caller_ends_its_sandbox(call):
    script = (f"import sys\nsys.path.insert(0, {ROOT!r})\n"
              "from scoring import execute, sandbox\nsandbox.best()\n")
    script += f"print('probed', flush=True)\nexecute.{call}"
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    inside = []
    try:
        assert caller.stdout.readline() == "probed\n"  # the probe's own sandbox has come and gone
        deadline = time.monotonic() + 30
        # until the harness runs in the sandbox, as the sandbox's uid
        while max(map(uid, below(caller.pid)), default=-1) < sandbox.UID_BASE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        inside = below(caller.pid)  # unshare, and the sandbox's first process (the harness)
        assert len(inside) >= 2 and uid(inside[-1]) >= sandbox.UID_BASE, inside
        caller.kill()
        deadline = time.monotonic() + 5
        while alive(inside) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(inside) == []
    finally:
        caller.kill()
        caller.wait()
        for pid in alive(inside):
            os.kill(pid, signal.SIGKILL)
