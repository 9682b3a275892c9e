"""The reward runner: a task's reward (or TRL reward functions) over a batch of completions, each
call under a deadline, in forked children; what a call returns, as named floats.

    task_rewards(task, texts, problems, timeout)  # episodes.task.score's (and the audit's): a
                                                  # row's {name: float}, or why its call failed
    within(seconds, fn, *args)  # a deadline in this process: the math verifier's, an environment's

The reward runs in a forked child process with a deadline (reward_timeout): a reward that raises or
hangs scores 0 for that completion and is counted in reward/errors; the run goes on. Module state
the reward changes therefore does not persist from batch to batch. Every process a reward starts (a
daemon that double-forks too) is ended when its call ends, and the reward's process dies with the
trainer. reward_timeout=0 runs it in-process: no deadline, and what it starts is its own to end (a
helper process may live across batches).
"""

import asyncio
import functools
import inspect
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback

from scoring import execute, sandbox


def as_components(value):
    """A reward's return value as {name: float}:
    a float becomes {"score": float}. Raises TypeError otherwise."""
    if isinstance(value, (int, float)):
        value = {"score": value}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                              for k, v in value.items()):
        raise TypeError(f"wrong type: returned {value!r:.80}; expected a float or a dict of named "
                        "floats")
    try:
        floats = {k: float(v) for k, v in value.items()}
    except OverflowError:  # an int past float's range, e.g. 10**400
        raise TypeError("wrong type: returned an integer too large for a float") from None
    if not all(math.isfinite(v) for v in floats.values()):
        raise TypeError(f"wrong type: returned a non-finite value {value!r:.80}")
    return floats


# after(): after each call, before its send
def _score_all(reward, jobs, send, check, after=lambda: None):
    """Call reward(*args) for each job (i, args) in order; send (i, check(value), "") or
    (i, "error" | "wrong type: ...", detail)."""
    for i, args in jobs:
        try:
            value = reward(*args)
        except BaseException:  # anything the reward does, sys.exit included, fails only this job
            after()
            send((i, "error", traceback.format_exc()))
            continue
        after()
        try:
            send((i, check(value), ""))
        except TypeError as e:
            send((i, str(e), ""))


def _child(reward, jobs, check, conn, parent):
    sandbox.die_with_parent(parent)  # kill -9 of the trainer ends this worker too
    sandbox.become_subreaper()  # what the reward starts stays below the worker, even a daemon
    _score_all(reward, jobs, conn.send, check, after=_end_leftovers)
    conn.close()


def _live_children():
    """{pid: [its live children]} of every process, from /proc (Linux; {} elsewhere)."""
    children = {}
    for name in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{name}/stat") as f:
                # the name in (...) may hold spaces
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if state not in "ZX":
            children.setdefault(int(ppid), []).append(int(name))
    return children


def end_tree(root, with_root=False, spare=()):
    """SIGKILL every live process below `root` (and root itself if with_root), but the subtrees of
    `spare`. Each is stopped first, so none can fork or die (and so leave the tree) while the tree
    is read."""
    stopped = {root} if with_root else set()
    try:
        _signal(stopped, signal.SIGSTOP)
        while True:
            children, todo, below = _live_children(), [root], set()
            while todo:
                kids = [k for k in children.get(todo.pop(), []) if k not in spare]
                below.update(kids)
                todo += kids
            if not below - stopped:
                break
            _signal(below - stopped, signal.SIGSTOP)
            stopped |= below
    finally:  # a stopped process is never left behind
        _signal(stopped, signal.SIGKILL)


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # gone already
            pass


def _end_leftovers():
    """After a reward call in a worker (a child subreaper): kill and reap all the reward left, but a
    Scorer's sandbox, which serves the worker's next call (execute.KEPT)."""
    deadline, ended = time.monotonic() + 5, False
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child, so nothing below: an orphan would have become this process's child
        if pid:
            continue  # reaped one
        if not set(_live_children().get(os.getpid(), [])) - execute.KEPT:
            return  # the Scorers alone remain
        if not ended:
            end_tree(os.getpid(), spare=execute.KEPT)
            ended = True
        else:
            time.sleep(0.001)


_REPORTED = set()  # the first failure of each kind is printed once per process, then only counted
FAILURES = {"error": "a reward raised (or its process died)",
            "timeout": "a reward ran past reward_timeout"}


def report(value, detail):
    """A failed reward's warning, once a process for each kind: value is run_rewards' string."""
    kind = value if value in FAILURES else "wrong type"
    if kind not in _REPORTED:
        _REPORTED.add(kind)
        print(f"warning: {FAILURES.get(kind, 'a reward returned the wrong type')}; the completion "
              f"scores 0 and is counted in reward/errors (printed once):\n{detail}",
              file=sys.stderr)


def run_rewards(reward, texts, problems, timeout, workers=1, quiet=False, failed=None):
    """reward(text, problem) for each completion: a components dict, or a string saying why it
    failed ("error", "timeout", "wrong type: ..."). With timeout > 0, `workers` forked children each
    score a share in order; one that sends nothing for `timeout` s is killed, its completion marked
    "timeout", and a fresh child goes on with the rest. A worker kills every process its reward
    leaves (after each call), and is killed with them on a timeout. timeout = 0: in this process, no
    deadline, none killed. Each failure is reported (once a process for each kind), or not (quiet),
    or given to failed(value, detail) with its traceback or reason."""
    jobs = [(i, (t, p)) for i, (t, p) in enumerate(zip(texts, problems))]
    failed = failed or (ignore if quiet else report)
    return _run_jobs(reward, jobs, as_components, timeout, workers, failed)


def ignore(*args):
    pass


def _run_jobs(reward, jobs, check, timeout, workers, failed, size=lambda args: 1):
    """run_rewards for any jobs (i, args), i = 0, 1, ...: reward(*args) then check(value), or why
    it failed. A job has timeout * size(args) seconds."""
    results, workers = [None] * len(jobs), max(1, workers)

    def record(message):
        i, value, detail = message
        results[i] = value
        if isinstance(value, str):
            failed(value, detail or value)

    if not timeout:
        _score_all(reward, jobs, record, check)
        return results
    # the child inherits the task module: any function works
    ctx = multiprocessing.get_context("fork")

    def start(share):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(reward, share, check, child, os.getpid()),
                           daemon=True)
        proc.start()
        child.close()
        return parent, [proc, share, time.monotonic() + timeout * size(share[0][1])]

    running = dict(start(jobs[w::workers]) for w in range(min(workers, len(jobs))))
    while running:
        soonest = min(state[2] for state in running.values())
        ready = multiprocessing.connection.wait(list(running), max(0.0, soonest - time.monotonic()))
        for conn in list(running):
            proc, share, deadline = running.pop(conn)
            if conn in ready:
                try:
                    message, dead = conn.recv(), False
                except EOFError:  # the child died (a crash, os._exit) while scoring share[0]
                    proc.join()
                    message, dead = (share[0][0], "error",
                                     f"its process died (exit code {proc.exitcode})"), True
            elif time.monotonic() >= deadline:
                end_tree(proc.pid, with_root=True)  # the worker and all its reward started
                message, dead = (share[0][0], "timeout",
                                 f"no result within reward_timeout={timeout} s"), True
            else:
                running[conn] = [proc, share, deadline]
                continue
            record(message)
            rest = share[1:]
            if dead:
                proc.join()
                if rest:  # a fresh child for the rest of this share
                    running.update([start(rest)])
            elif rest:
                running[conn] = [proc, rest, time.monotonic() + timeout * size(rest[0][1])]
            else:
                proc.join()
    return results


# ---------------------------------------------------------------- a deadline in this process


# s: past the deadline, how soon it raises again (the timer refires; off the main thread the trace
# comes back), in case Python dropped the raise in a finalizer
REFIRE = 0.05


class OutOfTime(BaseException):
    """Raised inside a check past its deadline. A BaseException: math-verify and sympy catch
    Exception everywhere, and must not swallow it."""


def _out_of_time(*_):
    raise OutOfTime


def within(seconds, fn, *args):
    """fn(*args), or OutOfTime once `seconds` have passed. Neither way can stop one long C call (a
    huge integer power): the math check's guard (rewards._too_big) keeps those out.

    In the main thread (a reward worker's, or reward_timeout=0) a SIGALRM timer, free while it runs;
    a timer the caller had set (pytest-timeout, its own alarm) is put back after. Elsewhere, where
    signals cannot go (and where math-verify's own signal.alarm timeouts raise), a trace function
    that checks the clock at every Python call: 3-4x slower, so only there. A within inside another
    keeps the sooner deadline.

    Either way the deadline raises again, every REFIRE s, until the check is over: Python prints
    and drops an exception raised inside a finalizer (a generator closed as it is collected, which
    parsers leave behind at every short-cut any(), or a __del__), so one raise alone can be lost,
    and the check would run on unbounded.
    """
    try:
        old_handler = signal.signal(signal.SIGALRM, _out_of_time)
    except ValueError:  # not the main thread
        return _traced_within(seconds, fn, *args)
    start = time.monotonic()
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds, REFIRE)
    if old_handler is _out_of_time and 0 < old_delay < seconds:  # the outer within's is sooner
        signal.setitimer(signal.ITIMER_REAL, old_delay, REFIRE)
    try:
        try:
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)  # an alarm already due raises here, once
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:  # the caller's own timer, less the time spent here (already due: at once)
            left = max(1e-6, old_delay - (time.monotonic() - start))
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


def _traced_within(seconds, fn, *args):
    """within off the main thread: the clock checked at every Python call. Python unsets a trace
    function that raises; past the deadline a profile function (never raising, so never unset)
    puts it back REFIRE s after each raise, in case that raise was dropped. Not sooner: the with
    and finally blocks the raise runs on its way out must run whole (sympy's `with workprec`
    restores mpmath's precision, for the whole process). Under a profiler already on, no second
    raise."""
    deadline = min(time.monotonic() + seconds, getattr(sys.gettrace(), "deadline", math.inf))
    raised = [math.inf]  # when check last raised

    def check(frame, event, arg):
        if time.monotonic() > deadline:
            if sys.getprofile() is None:
                sys.setprofile(rearm)
            raised[0] = time.monotonic()
            raise OutOfTime

    def rearm(frame, event, arg):
        if sys.gettrace() is None and time.monotonic() - raised[0] > REFIRE:
            sys.settrace(check)

    check.deadline = deadline  # for a within inside this one
    old_trace = sys.gettrace()
    sys.settrace(check)
    try:
        return fn(*args)
    finally:
        if sys.getprofile() is rearm:
            sys.setprofile(None)  # first: rearm would put check back
        sys.settrace(old_trace)


# ---------------------------------------------------------------- TRL-style reward functions

def is_chat(p):
    """True for a non-empty list of {"role": ..., "content": str} messages."""
    return isinstance(p, list) and bool(p) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in p)


# TRL passes the prompt and the completion by their own names; a column of such a name would clash
NOT_COLUMNS = {"prompt", "completion", "completion_ids", "prompts", "completions"}


def run_reward_funcs(task, texts, problems, timeout, workers=1, completion_ids=None, quiet=False,
                     failed=None):
    """TRL's reward functions on N completions, as run_rewards runs reward(): per completion
    {function name: score} (a None left out, "correct" and "unscored" added; reward_rows), or a
    string saying why it failed. Each function is called once per share of the batch: the whole
    batch, or with workers > 1 that many contiguous shares scored at once (as under TRL on several
    GPUs, a function sees only a share). A function that raises, hangs or returns the wrong type
    fails its share: each completion of it scores 0 and is counted in reward/errors. A share of n
    completions has n * timeout seconds, the deadline reward() would have on them."""
    if not texts:
        return []
    n, workers = len(texts), max(1, min(workers, len(texts)))
    ids = completion_ids or [None] * n  # None where the text was not sampled (the audit, replay)
    shares = [range(w * n // workers, (w + 1) * n // workers) for w in range(workers)]
    jobs = [(k, ([texts[i] for i in r], [problems[i] for i in r], [ids[i] for i in r]))
            for k, r in enumerate(shares)]
    done = _run_jobs(functools.partial(call_reward_funcs, task), jobs,
                     functools.partial(reward_rows, task), timeout, workers,
                     failed or (ignore if quiet else report),
                     size=lambda args: len(args[0]))
    # a failed share: its reason for each of its completions
    results = [row for r, out in zip(shares, done)
               for row in (out if isinstance(out, list) else [out] * len(r))]
    unscored = [i for i, row in enumerate(results) if isinstance(row, dict) and row["unscored"]]
    if unscored and not quiet and "unscored" not in _REPORTED:  # TRL warns too
        _REPORTED.add("unscored")
        print(f"warning: every reward function returned None for a completion; it scores 0 and is "
              "counted in reward/unscored (printed once):\n"
              f"problem {problems[unscored[0]]!r:.300}\ncompletion {texts[unscored[0]]!r:.300}",
              file=sys.stderr)
    return results


def call_reward_funcs(task, texts, problems, ids):
    """TRL's call: each reward function once on these completions, with prompts (prompt()'s
    values), completions, completion_ids and a keyword per problem key, TRL's dataset columns
    ("id" too; not TRL's trainer_state, log_extra, log_metric). Returns (n, {name: its list})."""
    prompts = [task.prompt(p) for p in problems]
    # a chat prompt's completion is the assistant's message, as TRL passes it
    completions = [[{"role": "assistant", "content": t}] if is_chat(p) else t
                   for t, p in zip(texts, prompts)]
    keys = sorted({k for p in problems for k in p} - NOT_COLUMNS)
    columns = {k: [p.get(k) for p in problems] for k in keys}
    out = {}
    for name, f in zip(task.reward_names, task.reward_funcs):
        out[name] = f(prompts=prompts, completions=completions, completion_ids=ids, **columns)
        if inspect.iscoroutine(out[name]):  # an async function, as TRL allows (e.g. an LLM judge)
            out[name] = asyncio.run(out[name])
    return len(texts), out


def reward_rows(task, called):
    """(n, {name: n scores}) -> n components dicts, as TRL treats the scores: a list, tuple, numpy
    array or tensor of n numbers (numpy and torch scalars too) or None; a None, NaN or inf is left
    out (TRL turns None into NaN and its nansum leaves NaN out: one NaN does not fail the batch).
    "correct" = the CORRECT function's score; "unscored" 1.0 where every function left the
    completion out: score_batch gives it reward NaN, so its group's baseline leaves it out and its
    advantage is 0 (group_advantages), as in TRL."""
    n, values = called
    rows = [{} for _ in range(n)]
    for name, scores in values.items():
        if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__") \
                or len(scores) != n:
            raise TypeError(f"wrong type: reward function {name} returned {scores!r:.80}; "
                            f"expected a list of {n} floats (or None), one per completion")
        for row, value in zip(rows, scores):
            score = as_score(value)
            if score is False:
                raise TypeError(f"wrong type: reward function {name} returned {value!r:.80}; "
                                "expected a float or None")
            if score is not None:
                row[name] = score
    for row in rows:
        row["unscored"] = float(not row)
        if task.correct in row:
            row["correct"] = row[task.correct]
    return rows


def as_score(value):
    """A reward function's score as a float; None for None, NaN or inf (left out, as TRL's nansum
    leaves them); False for what is no number (a string, a list, a tensor of several values)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return False
    try:
        score = float(value)  # a numpy or torch scalar, a 1-element tensor
    except OverflowError:  # an int past float's range
        return None
    except (TypeError, ValueError, RuntimeError):
        return False
    return score if math.isfinite(score) else None


# ---------------------------------------------------------------- scoring


def task_rewards(task, texts, problems, timeout, workers=1, completion_ids=None, quiet=False,
                 failed=None):
    """The task's components for each completion (or why it failed): reward() or reward_funcs."""
    if task.executes_text:  # each call in a sandboxed process of its own, under its deadline
        timeout, workers = 0, 1
    if task.reward_funcs:
        return run_reward_funcs(task, texts, problems, timeout, workers, completion_ids, quiet,
                                failed)
    if task.reward is None:  # an environment's rewards alone (score adds them)
        return [{} for _ in texts]
    return run_rewards(task.reward, texts, problems, timeout, workers, quiet, failed)
