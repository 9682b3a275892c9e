"""Rule-based verifiers (SPEC W1-W6): Countdown, math and code, and the shaping every task's reward gets.

A policy finds every hole in a reward, so every verifier here assumes adversarial input: answers
are found with str.rfind (no regex that can backtrack for minutes on 100 KB of tags), Countdown
expressions are parsed with `ast` and evaluated by our own 15-line tree walk (never `eval`),
sympy runs in a child process with a deadline, and code runs in a sandbox process.

Per completion, each verifier returns a dict of components, all floats:
    format   1.0 if the text is exactly <think>...</think><answer>...</answer> with a non-empty answer (W2)
    parsed   1.0 if an answer was found and is well-formed for the task
    correct  1.0 / 0.0 (code: the fraction of tests passed)
The task files in tasks/ call these verifiers (task.py loads them); `score_batch` turns a batch's
components into one shaped reward per completion (W2-W3), whatever the task.

    python rewards.py --replay out/run/samples.jsonl   # re-score saved rollouts, print disagreements (W5)
"""

import ast
import json
import math
import multiprocessing
import os
import re
import secrets
import select
import shlex
import shutil
import subprocess
import sys
import time
from fractions import Fraction

import torch

MAX_ANSWER_CHARS = 256  # longer answers are not parsed at all: no real answer here is that long


# ---------------------------------------------------------------- extraction and format (W2, W4)


def extract_answer(text):
    """The content of the last <answer>...</answer> that is not inside a think block, stripped; else None.

    Nested or repeated tags cannot score twice: only the last closing tag and the nearest opening
    tag before it count, so '<answer><answer>1</answer></answer>' yields '1</answer>', which no
    verifier accepts (W4).
    """
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    if text.rfind("<think>", 0, start) > text.rfind("</think>", 0, start):
        return None  # an answer inside an unclosed think block is thinking, not answering
    return text[start + len("<answer>") : end].strip()


def has_format(text):
    """W2: exactly one <think>...</think> then exactly one non-empty <answer>...</answer>, nothing after."""
    t = text.strip()
    if not (t.startswith("<think>") and t.endswith("</answer>")):
        return False
    if any(t.count(tag) != 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")):
        return False
    think_end, answer_start = t.index("</think>") + len("</think>"), t.index("<answer>")
    if think_end > answer_start or t[think_end:answer_start].strip():
        return False
    return extract_answer(t) not in (None, "")  # W4: empty answer, no credit


# ---------------------------------------------------------------- Countdown (W1)

COUNTDOWN_CHARS = re.compile(r"[0-9+\-*/() ]+")  # ASCII only: \d would also match unicode digits
COUNTDOWN_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
                 ast.Div: Fraction.__truediv__}


def _countdown_eval(node, numbers):
    """Exact value of an ast of integer literals and binary + - * /; appends each literal to `numbers`.

    Returns None if the tree divides by zero anywhere (after visiting every literal, so the numbers
    are still checked). Raises ValueError on anything else (names, calls, **, //, unary minus, floats).
    """
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in COUNTDOWN_OPS:
        left, right = _countdown_eval(node.left, numbers), _countdown_eval(node.right, numbers)
        if left is None or right is None or (type(node.op) is ast.Div and right == 0):
            return None
        return COUNTDOWN_OPS[type(node.op)](left, right)
    raise ValueError(f"not allowed in Countdown: {type(node).__name__}")


def countdown_reward(text, numbers, target):
    """Countdown: the answer uses each given number exactly once with + - * / ( ), and equals target.

    Example: countdown_reward("<think>..</think><answer>(6 - 2) * 5</answer>", [2, 5, 6], 20)
    -> {"format": 1.0, "parsed": 1.0, "numbers_valid": 1.0, "correct": 1.0}
    """
    out = {"format": float(has_format(text)), "parsed": 0.0, "numbers_valid": 0.0, "correct": 0.0}
    answer = extract_answer(text)
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return out
    answer = " ".join(answer.split())  # newlines and tabs inside the tag are just spaces
    if not COUNTDOWN_CHARS.fullmatch(answer):
        return out
    used = []
    try:
        value = _countdown_eval(ast.parse(answer, mode="eval").body, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return out  # malformed, or an operation Countdown does not allow
    out["parsed"] = 1.0  # a well-formed equation; one that divides by zero (value None) cannot be correct
    out["numbers_valid"] = float(sorted(used) == sorted(numbers))
    if out["numbers_valid"] and value is not None:
        out["correct"] = float(abs(value - target) < Fraction(1, 100000))  # within 1e-5 (W1)
    return out


# ---------------------------------------------------------------- math (W1)


def last_boxed(text):
    """Content of the last \\boxed{...} with balanced braces, or None (unbalanced counts as none)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


LATEX_REPLACEMENTS = [
    (r"\\[dt]frac", r"\\frac"), (r"\\left|\\right|\\!|\\,|\\;|\$", ""), (r"\\text\{[^{}]*\}", ""),
    (r"\\cdot|\\times", "*"), (r"\\pi", "pi"), (r"\^", "**"), (r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)"),
]


def normalize_math(s):
    """LaTeX-ish answer -> a plain expression string: '\\frac{1}{2}' -> '(1)/(2)', '1,000' -> '1000'."""
    s = s.strip().rstrip(".")
    for pattern, repl in LATEX_REPLACEMENTS:
        s = re.sub(pattern, repl, s)
    while "\\frac{" in s:  # innermost first: \frac{a}{b} with brace-free a and b
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
        if new == s:
            break
        s = new
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.replace(" ", "")
    return re.sub(r"(?<=[\d)])(?=[a-z(])", "*", s)  # implicit products: 2x -> 2*x, (a)(b) -> (a)*(b)


def as_fraction(s):
    """'3', '-0.25', '(1)/(2)', '-(9)/(4)', '7/2' -> Fraction, else None: a plain number, exactly."""
    m = re.fullmatch(r"(-?)\(?(-?\d+(?:\.\d+)?)\)?(?:/\(?(-?\d+(?:\.\d+)?)\)?)?", s)
    if not m:
        return None
    num, den = Fraction(m.group(2)), Fraction(m.group(3) or 1)
    return (-1 if m.group(1) else 1) * num / den if den else None


def in_lowest_terms(s):
    """False for a normalised fraction of whole numbers that can be reduced ('(4)/(6)', '8/4', '3/1'); else True."""
    m = re.fullmatch(r"-?\(?(-?\d+)\)?/\(?(-?\d+)\)?", s)
    if not m:
        return True  # a whole number or a decimal
    num, den = int(m.group(1)), int(m.group(2))
    return math.gcd(num, den) == 1 and abs(den) != 1


def before_unclosed_think(text):
    """The text before a <think> that is never closed: what follows it is thinking, not answering (W4)."""
    start = text.rfind("<think>")
    return text[:start] if start >= 0 and text.find("</think>", start) < 0 else text


def after_tool_outputs(text, tags=("<output>", "</output>")):
    """The model's own text after the last tool output (rollout.TOOL_OUTPUT's tags): the only place a tool task's
    answer is judged, so what a tool printed never counts as the model's answer. Text without an output is
    returned whole; an output never closed leaves nothing (all after its opening tag is the tool's). A <think>
    open where the last output ends stays open ("<think>" put in front), so an answer inside it is still
    thinking (W4).
    """
    end = text.rfind(tags[1])
    cut = end + len(tags[1]) if end >= 0 else 0
    own = text[cut:]
    if tags[0] in own:
        return ""
    thinking = text.rfind("<think>", 0, cut) > text.rfind("</think>", 0, cut)
    return "<think>" + own if thinking else own


# a number, with thousands separators read whole ("1,234" is 1234, not 234)
LAST_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")

SYMPY_NAMES = {"sqrt", "pi", "x", "y", "z", "n", "a", "b", "c", "k"}


def _sympy_equal(a, b, conn):
    """Child process: send whether a - b simplifies to 0."""
    import sympy

    try:
        diff = sympy.sympify(a, locals={}) - sympy.sympify(b, locals={})
        conn.send(bool(sympy.simplify(diff) == 0))
    except Exception:
        conn.send(False)


def symbolic_equal(a, b, timeout=2.0):
    """a == b by sympy, in a forked child killed after `timeout` s (sympy can hang on adversarial input)."""
    for s in (a, b):  # sympify evaluates Python: admit only arithmetic and a few known names
        if len(s) > 100 or not re.fullmatch(r"[0-9a-z+\-*/().]*", s) or "__" in s or not re.search(r"[0-9a-z]", s):
            return False  # not arithmetic over known names (e.g. a copied "...")
        if set(re.findall(r"[a-z]+", s)) - SYMPY_NAMES:
            return False
    import sympy  # noqa: F401  (imported before the fork, so the child never imports under a lock)

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_sympy_equal, args=(a, b, child), daemon=True)
    proc.start()
    result = parent.recv() if parent.poll(timeout) else False
    proc.kill()
    proc.join()
    return result


def math_reward(text, answer, last_number=False, tools=False):
    """Math: the last \\boxed{} (else the <answer> content) equals `answer`, exactly or by sympy.

    last_number: with no box and no tag, judge the last number in the text instead (lm-eval's
    "flexible extract"); `parsed` stays 0 then, so unparsed_penalty still asks for a tagged answer.
    tools: the box, the tag and the last number are looked for only in the model's own text after the last
    tool output (after_tool_outputs); the format is still the whole completion's.

    Example: math_reward("<think>..</think><answer>\\boxed{\\frac{1}{2}}</answer>", "0.5")
    -> {"format": 1.0, "parsed": 1.0, "correct": 1.0}
    """
    out = {"format": float(has_format(text)), "parsed": 0.0, "correct": 0.0}
    own = after_tool_outputs(text) if tools else text
    tagged = extract_answer(own)
    given = last_boxed(tagged if tagged is not None else before_unclosed_think(own))
    if given is None:
        given = tagged
    if given is None and last_number:
        numbers = LAST_NUMBER.findall(before_unclosed_think(own)[-2000:])
        fa = as_fraction(numbers[-1].replace(",", "")) if numbers else None
        return {**out, "correct": float(fa is not None and fa == as_fraction(normalize_math(str(answer))))}
    if not given or len(given) > MAX_ANSWER_CHARS:
        return {**out, "format": 0.0}  # W4: an empty \boxed{} or <answer> scores nothing, not even format
    got, want = normalize_math(given), normalize_math(str(answer))
    if as_fraction(want) is not None:
        # W4: a numeric reference needs a number, compared exactly. "13+14" restates "what is 13 + 14?",
        # and a copied "\boxed{...}" from the prompt is no answer: neither earns parsed or format credit.
        if as_fraction(got) is None:
            return {**out, "format": 0.0}
        # a fraction counts only in lowest terms, the form the prompt asks for: 4/6 is not 2/3's answer
        exact = as_fraction(got) == as_fraction(want) and in_lowest_terms(got)
        out["parsed"], out["correct"] = 1.0, float(exact)
    else:
        out["parsed"], out["correct"] = 1.0, float(got == want or symbolic_equal(got, want))
    return out


# ---------------------------------------------------------------- code (W1)


def last_code_block(text):
    """The last ```...``` block with its language line dropped, or None (rfind: linear on any input)."""
    end = text.rfind("```")
    start = text.rfind("```", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    first_line, _, body = text[start + 3 : end].partition("\n")
    return body if first_line.strip() in ("", "python", "py", "python3") else None

# Runs inside the sandbox. The job (code, tests, a secret nonce) arrives on stdin, so nothing is
# written to disk. User output goes to /dev/null; results go to a private copy of stdout, each line
# carrying the nonce, so code that exits early or prints fake results cannot pass a test it did not run.
HARNESS = r"""
import json, os, resource, sys
job = json.loads(sys.stdin.read())
out = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1); os.dup2(null, 2)
for name, limit in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (limit, limit))
exact = type
def plain(x):  # exact builtin types only: an object whose __eq__ always says True is not a result
    if exact(x) in (int, float, str, bool, type(None)): return x
    if exact(x) in (list, tuple): return [plain(v) for v in x]
    if exact(x) is dict and all(exact(k) is str for k in x): return {k: plain(v) for k, v in x.items()}
    raise TypeError("not a plain value")
scope = {"__name__": "__main__"}
try:
    exec(compile(job["code"], "solution.py", "exec"), scope); loaded = True
except BaseException:
    loaded = False
for i, test in enumerate(job["tests"]):
    ok, value = loaded, None
    try:
        if ok and isinstance(test, str):
            exec(compile(test, f"test_{i}", "exec"), scope)
        elif ok:
            value = plain(eval(compile(test["call"], f"test_{i}", "eval"), scope))
    except BaseException:
        ok = False
    out.write(json.dumps([job["nonce"], i, ok, value]) + "\n"); out.flush()
"""


SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}  # no secrets from our environment
_SANDBOX = None  # the prefix, probed once (sandbox())


def _python_dirs():
    """The folders the sandbox's Python needs, read-only: its installation (and a venv's own folder)."""
    return sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)})


def _file_view():
    """Shell lines that build the sandbox's whole filesystem and make it the root (pivot_root).

    The new root is a tmpfs holding only: /usr (and /bin, /lib... as the host has them), the Python
    installation with its site-packages hidden (the harness needs the standard library only), /dev/null,
    /dev/zero, /dev/urandom, a fresh /proc of the sandbox's own PID namespace, and a private /tmp. No
    /etc, /home, /root, project folder or dataset: code can read nothing it was not given.
    """
    q = shlex.quote
    lines = ["set -e", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "mount -t tmpfs -o size=64m tmpfs /tmp",
             "mkdir /tmp/root", "mount -t tmpfs -o size=64m tmpfs /tmp/root", "cd /tmp/root", "mkdir dev proc tmp old"]
    for d in ("/usr", *_python_dirs()):
        if os.path.isdir(d):
            lines.append(f"mkdir -p {q('.' + d)} && mount --rbind -o ro {q(d)} {q('.' + d)}")
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):  # a merged-/usr system: /lib -> usr/lib
            lines.append(f"ln -s {q(os.readlink(d))} .{d}")
        elif os.path.isdir(d):
            lines.append(f"mkdir .{d} && mount --rbind -o ro {d} .{d}")
    for site in {os.path.realpath(p) for p in sys.path if p.endswith("-packages") and os.path.isdir(p)}:
        lines.append(f"mount -t tmpfs -o ro,size=1m tmpfs {q('.' + site)}")  # installed packages: hidden
    for dev in ("null", "zero", "urandom"):
        lines.append(f"touch dev/{dev} && mount --bind /dev/{dev} dev/{dev}")
    # the old root is detached once /proc (which umount reads) is the sandbox's own
    lines += ["mount -t tmpfs -o size=64m tmpfs tmp", "pivot_root . old", "mount -t proc proc /proc",
              "umount -l /old", "rmdir /old"]
    return "; ".join(lines)


def _sandbox_prefix():
    """The command prefix that runs code in the sandbox, and what it leaves reachable ("" when nothing).

    Best: network, PID and mount namespaces, uid nobody (when we are root), and a filesystem holding only
    Python's standard library (_file_view). Where that mount fails: the namespaces with a private /tmp
    but the host's files readable. Where unshare is refused: a plain child process. Both fallbacks say so.
    """
    if not shutil.which("unshare"):
        return [], "unshare is missing: the code runs as a plain child process, with network and every file"
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    drop = "exec setpriv --reuid=65534 --regid=65534 --clear-groups" if os.geteuid() == 0 else "exec"
    private_tmp = "for d in /tmp /var/tmp /dev/shm; do mount -t tmpfs -o size=64m tmpfs $d; done"
    # --kill-child + --pid: when the sandbox's first process dies, the kernel kills all it forked
    unshare = ["unshare", *user, "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    tiers = [(_file_view(), ""),
             (private_tmp, "the sandbox's filesystem view failed: code runs without network, but can read "
                           "every world-readable file (the project, its data)"),
             (None, "unshare is not permitted here: code runs as a plain child process, with network and "
                    "every file")]
    for setup, weaker in tiers:
        if setup is None:
            return [], weaker
        prefix = [*unshare, "sh", "-c", f'{setup}; cd /tmp && {drop} "$@"', "sandbox"]
        probe = subprocess.run([*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30,
                               env=SANDBOX_ENV, cwd="/tmp")
        if probe.returncode == 0:
            return prefix, weaker


def sandbox():
    """The sandbox prefix, probed once per process; a weaker fallback is said once, loudly."""
    global _SANDBOX
    if _SANDBOX is None:
        _SANDBOX, weaker = _sandbox_prefix()
        if weaker:
            print(f"warning: {weaker}. Run where unprivileged user namespaces are allowed (or as root) for "
                  f"the full sandbox.", file=sys.stderr)
    return _SANDBOX



def run_tests(code, tests, timeout=5.0, memory_mb=512):
    """Run `code` then each test in the sandbox; returns per test (ran without error, returned value)."""
    nonce = secrets.token_hex(16)
    limits = {"RLIMIT_AS": memory_mb << 20, "RLIMIT_FSIZE": 1 << 20, "RLIMIT_NPROC": 64, "RLIMIT_CORE": 0,
              "RLIMIT_CPU": math.ceil(timeout) + 1}
    job = json.dumps({"code": code, "tests": tests, "nonce": nonce, "limits": limits})
    cmd = [*sandbox(), sys.executable, "-I", "-c", HARNESS]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=SANDBOX_ENV, cwd="/tmp", start_new_session=True)
    try:
        stdout, _ = proc.communicate(job.encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout = b""  # W1: a timeout scores 0 for every test
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # the whole group; --kill-child then takes down the sandbox
        proc.wait()
    results = [(False, None)] * len(tests)  # a test without a result line did not pass
    for line in stdout.decode(errors="replace").splitlines():
        try:
            tag, i, ok, value = json.loads(line)
        except (ValueError, TypeError):
            continue
        if tag == nonce and type(i) is int and 0 <= i < len(tests):
            results[i] = (ok is True, value)
    return results


def code_reward(text, tests, timeout=5.0):
    """Code: run the last ```python block against `tests`; correct = fraction passed (W1).

    tests: a list of assert statements ("assert add(1, 2) == 3"), or of {"call": "add(1, 2)",
    "expected": 3} checked exactly (type and value) outside the sandbox. Prefer the second form for
    training: an assert can be fooled by a returned object whose __eq__ always says True.
    """
    out = {"format": float(has_format(text)), "parsed": 0.0, "correct": 0.0}
    code = last_code_block(extract_answer(text) or text)
    if not code or not tests:
        return out
    out["parsed"] = 1.0
    results = run_tests(code, tests, timeout)
    passed = [ok and (isinstance(t, str) or value == json.loads(json.dumps(t["expected"])))  # tuples as lists
              for t, (ok, value) in zip(tests, results)]
    out["correct"] = sum(passed) / len(tests)
    return out


# ---------------------------------------------------------------- the Python tool (multi-turn rollouts)

# Runs inside the sandbox: the code arrives on stdin; what it prints is the tool's output. An exception
# prints one line (its type and message), not a traceback of the harness.
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

    output: what it printed (stdout and stderr), at most max_output characters, cut with a marker. ok is
    False when the code raised, was killed (timeout, memory, output past the limit) or exited non-zero. Output
    is read as it comes and the sandbox killed past the limit, so a flood never fills our memory.
    """
    limits = {"RLIMIT_AS": memory_mb << 20, "RLIMIT_FSIZE": 1 << 20, "RLIMIT_NPROC": 64, "RLIMIT_CORE": 0,
              "RLIMIT_CPU": math.ceil(timeout) + 1}
    proc = subprocess.Popen([*sandbox(), sys.executable, "-I", "-c", TOOL_HARNESS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=SANDBOX_ENV, cwd="/tmp",
                            start_new_session=True)
    out, deadline, reason = b"", time.monotonic() + timeout, None
    try:
        proc.stdin.write(json.dumps({"code": code, "limits": limits}).encode())
        proc.stdin.close()
        while reason is None:
            ready = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
            chunk = os.read(proc.stdout.fileno(), 1 << 16) if ready else b""
            out += chunk
            if not ready:
                reason = f"timed out after {timeout:g} s"
            elif len(out) > 4 * max_output:  # bytes; a UTF-8 character is at most 4
                reason = "output limit"
            elif not chunk:
                reason = "done"  # end of output: the code finished
    except BrokenPipeError:  # the sandbox died before reading the code
        reason = "done"
    finally:
        if proc.poll() is None and reason != "done":
            os.killpg(proc.pid, 9)  # the whole group; --kill-child then takes down the sandbox
        proc.wait()
    text = out.decode(errors="replace")
    if len(text) > max_output:
        text = text[:max_output] + "\n[output truncated]"
    if reason.startswith("timed out"):
        text += f"\n[{reason}]"
    return text, reason == "done" and proc.returncode == 0


# ---------------------------------------------------------------- the smoke-test task


def digits_reward(text):
    """A reward a random model can climb (config/tiny.py): the share of non-space characters that are digits."""
    chars = [c for c in text if not c.isspace()]
    share = sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0
    return {"format": float(has_format(text)), "parsed": float(bool(chars)), "correct": share}


# ---------------------------------------------------------------- the shaping (W2, W3)

OWN_SETTINGS = ("correct", "format", "parsed")  # components weighed by their own settings, not by `weights`


def shape_reward(c, length, *, weights=None, format_weight=0.1, correct_weight=1.0, wrong_penalty=0.0,
                 unparsed_penalty=0.0, length_soft_limit=0, length_penalty=0.05, length_penalty_tokens=32,
                 length_min=0):
    """One scalar from a completion's components and its length in tokens.

    W2: correct_weight * correct + format_weight * format + the task's other components, each times its
        weight in `weights` (default 1, as TRL's reward_weights). With a "parsed" component, a parseable
        but wrong answer adds wrong_penalty (small, e.g. -0.1), an unparseable one unparsed_penalty
        (larger, e.g. -0.5). (A common blog reward gives 0.4 when the answer tag is missing, rewarding
        the missing answer; not here.)
    W3: past length_soft_limit tokens, -length_penalty per length_penalty_tokens started;
        below length_min tokens the reward is 0. Both 0 = off.
    Example: correct, well formatted, 100 tokens, defaults -> 1.1.
    """
    weights = weights or {}
    reward = correct_weight * c.get("correct", 0.0) + format_weight * c.get("format", 0.0)
    reward += sum(weights.get(k, 1.0) * v for k, v in c.items() if k not in OWN_SETTINGS)
    if "parsed" in c and c["parsed"] and c.get("correct", 0.0) < 1:
        reward += wrong_penalty
    if "parsed" in c and not c["parsed"]:
        reward += unparsed_penalty
    if length_soft_limit and length > length_soft_limit:
        reward -= length_penalty * math.ceil((length - length_soft_limit) / length_penalty_tokens)
    if length_min and length < length_min:
        reward = 0.0
    return reward


def score_batch(results, lengths, weights=None, **shaping):
    """Shape N scored completions. Returns (rewards (N,) float32, {component: (N,) float32}).

    results: per completion its components dict, or a string saying why the reward failed ("error",
    "timeout", ...; task.run_rewards). A failed completion scores exactly 0 (no shaping, no penalty) and is
    counted in components["errors"] (timeouts also in components["timeouts"]). A component some
    completions lack is 0 for them. lengths: N completion lengths in tokens; weights, shaping: shape_reward's.
    """
    failed = [isinstance(c, str) for c in results]
    rewards = [0.0 if f else shape_reward(c, n, weights=weights, **shaping)
               for c, f, n in zip(results, failed, lengths)]
    names = sorted({k for c, f in zip(results, failed) if not f for k in c})
    per_component = {k: torch.tensor([0.0 if f else c.get(k, 0.0) for c, f in zip(results, failed)]) for k in names}
    per_component["errors"] = torch.tensor([float(f) for f in failed])
    per_component["timeouts"] = torch.tensor([float(c == "timeout") for c in results])
    return torch.tensor(rewards, dtype=torch.float32), per_component


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--replay":
        sys.exit("usage: python rewards.py --replay out/run/samples.jsonl")
    from task import replay  # re-scoring needs the run's task file, named in its config.json

    sys.exit(1 if replay(sys.argv[2]) else 0)
