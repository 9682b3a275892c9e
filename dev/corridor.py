"""The code one training step runs, function by function in call order: how much a reader reads.

    python -m dev.corridor                         # the default run's second step, as read
    python -m dev.corridor --as-run                # ... every function it runs
    python -m dev.corridor --config config/tiny.py --engine=hf --step 1
    python -m dev.corridor --table                 # every function, in call order

Runs grpo.main with a profiler on from the start of step `--step` (default 1: step 0 also evaluates
the base model) to the end of that step, and records each project function the first time it is
called, in the trainer and in the processes it forks (the reward runner's children). Prints the
lines (each function's whole source, a nested function counted with the one around it), the files,
and the jumps: how often the next function met lies in another file than the one before. Library
code (torch, vLLM, transformers) is not counted; neither is set-up before the step nor the final
eval.

As read (the default): the step a reader follows. The fast paths on by default (FAST_PATHS) each
enter through one `if cfg.x:` whose `else` is the plain code, so the step runs with them off and
the plain code is counted; the reward runner's process handling and the CPU kernels (PASSED_OVER)
each sit behind one call, listed in the table but not counted. --as-run counts everything the
default step runs.
"""

import argparse
import functools
import inspect
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = (os.path.join(ROOT, "tests") + os.sep, os.path.join(ROOT, "dev") + os.sep)
# on by default, each one `if cfg.x:` away from its plain `else` (perf/shared_prompt.py,
# perf/logprobs.py)
FAST_PATHS = ("--shared_prompt=false", "--chunked_logprobs=false")
# behind one call each: the reward runner (scoring/runner.py task_rewards: processes, deadlines,
# what a reward returns) and the sandbox; perf/cpu.py's attention kernel (installed at load) and
# vLLM-CPU's seed
PASSED_OVER = ("scoring" + os.sep, "perf" + os.sep)


def project_file(path):
    """A file of the project's own code (not tests/ or dev/, not a library)."""
    inside = os.path.isabs(path) and path.startswith(ROOT + os.sep) and not path.startswith(SKIP)
    return inside and os.sep + "." not in path[len(ROOT):]  # a .venv inside the project is not it


def trace_step(argv, step, record_path):
    """Run grpo.main(argv) and append (time, file, name, first line) of each project function called
    during `step` to record_path, forked children included."""
    sys.path.insert(0, ROOT)
    import grpo

    seen, on = set(), False
    out = open(record_path, "a", buffering=1)  # a line per record: a forked child writes its own

    def profiler(frame, event, arg):
        if event != "call" or not on:
            return
        code = frame.f_code
        key = (code.co_filename, code.co_firstlineno, code.co_name)
        if key in seen or code.co_name.startswith("<") or not project_file(code.co_filename):
            return
        seen.add(key)
        name = getattr(code, "co_qualname", code.co_name)  # Class.method from Python 3.11 on
        out.write(f"{time.monotonic_ns()}\t{os.path.relpath(code.co_filename, ROOT)}\t"
                  f"{name}\t{code.co_firstlineno}\n")

    temperature_at, end_step = grpo.temperature_at, grpo.end_step

    def start(s, cfg):  # the loop's first call of a step
        nonlocal on
        on = on or s == step
        return temperature_at(s, cfg)

    def stop(cfg, s, *args, **kwargs):  # the loop's last call of a step
        nonlocal on
        result = end_step(cfg, s, *args, **kwargs)
        on = on and s != step
        return result

    grpo.temperature_at, grpo.end_step = start, stop
    sys.setprofile(profiler)
    threading.setprofile(profiler)
    try:
        grpo.main(argv)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        out.close()


def read_records(path):
    """The functions recorded, in call order, each once: (file, name, first line, lines)."""
    rows = {}
    with open(path) as f:
        for line in f:
            t, file, name, first = line.rstrip("\n").split("\t")
            key = (file, name, int(first))
            rows[key] = min(rows.get(key, int(t)), int(t))
    ordered = sorted(rows, key=rows.get)
    result, spans = [], []
    for file, name, first in ordered:
        lines = sources(file)
        n = len(inspect.getblock(lines[first - 1:]))
        inside = any(f == file and a <= first < a + m for f, a, m in spans)
        if not inside:  # a nested function is read with the function around it
            spans.append((file, first, n))
            result.append((file, name, first, n))
    return result


@functools.cache
def sources(file):
    """The lines of a project file, read once."""
    with open(os.path.join(ROOT, file)) as f:
        return f.readlines()


def report(functions, table=False, as_run=False):
    """Print the table (with --table) and the totals; as read, PASSED_OVER's functions are listed
    but not counted."""
    passed = [f for f in functions if not as_run and f[0].startswith(PASSED_OVER)]
    read = [f for f in functions if f not in passed]
    jumps = sum(a[0] != b[0] for a, b in zip(read, read[1:]))
    files = {}
    for file, _, _, n in read:
        files[file] = files.get(file, 0) + n
    if table:
        print(f"{'#':>3}  {'file':<22} {'function':<40} {'lines':>5}")
        for i, (file, name, first, n) in enumerate(functions):
            shown = f"({n})" if (file, name, first, n) in passed else n
            print(f"{i:>3}  {file:<22} {name:<40} {shown:>5}")
    print(f"\n{'file':<22} {'lines':>5}")
    for file, n in sorted(files.items(), key=lambda kv: -kv[1]):
        print(f"{file:<22} {n:>5}")
    lines = sum(files.values())
    how = "as run" if as_run else "as read"
    print(f"\none step, {how}: {lines} lines in {len(read)} functions over {len(files)} files, "
          f"{jumps} jumps between files")
    if passed:
        print(f"passed over (behind one call each): {sum(f[3] for f in passed)} lines in "
              f"{len(passed)} functions of {', '.join(sorted({f[0] for f in passed}))}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=1, help="the step traced (0 also evaluates)")
    parser.add_argument("--table", action="store_true", help="print every function in call order")
    parser.add_argument("--as-run", action="store_true",
                        help="count all the step runs: fast paths on, nothing passed over")
    args, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="corridor_") as out_dir:  # the run's files go with it
        record = os.path.join(out_dir, "calls.tsv")
        # the source as it runs, whatever is edited meanwhile
        for folder, subfolders, names in os.walk(ROOT):
            # not .git, .venv or caches, nor the runs' out/
            subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "out"]
            for name in names:
                path = os.path.join(folder, name)
                if name.endswith(".py") and project_file(path):
                    sources(os.path.relpath(path, ROOT))
        fast_paths_off = () if args.as_run else FAST_PATHS
        # one step more than the traced one: the last step's final eval and checkpoint are not a
        # step's
        argv = [*fast_paths_off, *rest, f"--out_dir={out_dir}/run", f"--max_steps={args.step + 2}"]
        trace_step(argv, args.step, record)
        report(read_records(record), args.table, args.as_run)


if __name__ == "__main__":
    main()
