#!/usr/bin/env python3
"""Keeps README.md honest.

  readme_check.py outputs README.md --exe NAME=PATH ...
      Every code block preceded by `<!-- output of: NAME ARGS... -->` is what `NAME ARGS...`
      prints: the block is compared with a run, line by line (trailing blanks ignored). A block
      line that is just `...` stands for any number of lines of the run (zero included). Every
      NAME must be given with --exe; a block that differs fails with a diff.

  readme_check.py snippets README.md --work DIR --cxx CXX --include DIR --prelude-dir DIR
                  [--context NAME=FLAGS ...]
      Every ```cpp block must be preceded by `<!-- snippet: body|top CONTEXT -->`. The blocks of
      one context are compiled together, as one translation unit, after that context's prelude
      (PRELUDE_DIR/CONTEXT.hpp: the declarations the snippets take as given): a `body` block
      inside a function of its own, a `top` block at namespace scope. A context without --context
      flags (its framework was not found) is reported as not compiled; a block without a marker,
      or a context that does not compile, fails.
"""
import argparse
import difflib
import re
import shlex
import subprocess
import sys
from pathlib import Path

MARK_OUTPUT = re.compile(r"^<!-- output of: (.+?) -->\s*$")
MARK_SNIPPET = re.compile(r"^<!-- snippet: (body|top) ([A-Za-z0-9_]+) -->\s*$")
FENCE = re.compile(r"^```")


def blocks(lines):
    """(index of the opening fence, language, body lines, the marker line before it or None)."""
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            lang = m.group(1)
            j = i + 1
            while j < len(lines) and not FENCE.match(lines[j]):
                j += 1
            k = i - 1
            while k >= 0 and lines[k].strip() == "":
                k -= 1
            marker = lines[k] if k >= 0 and lines[k].startswith("<!--") else None
            yield i, lang, lines[i + 1 : j], marker
            i = j + 1
        else:
            i += 1


def matches(want, got):
    """Whether `got` (run lines) fits `want` (README lines, `...` = any run of lines)."""
    # dynamic programming over (want index, got index)
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def fit(a, b):
        if a == len(want):
            return b == len(got)
        if want[a].strip() == "...":
            return any(fit(a + 1, c) for c in range(b, len(got) + 1))
        return b < len(got) and want[a] == got[b] and fit(a + 1, b + 1)

    sys.setrecursionlimit(10000)
    return fit(0, 0)


def outputs(args):
    lines = Path(args.readme).read_text().splitlines()
    exes = dict(e.split("=", 1) for e in args.exe)
    checked = 0
    failed = 0
    for i, lang, body, marker in blocks(lines):
        m = MARK_OUTPUT.match(marker or "")
        if not m:
            continue
        argv = shlex.split(m.group(1))
        if argv[0] not in exes:
            print(f"README.md:{i + 1}: no --exe for '{argv[0]}'")
            return 1
        run = subprocess.run([exes[argv[0]]] + argv[1:], capture_output=True, text=True,
                             timeout=300)
        if run.returncode != 0:
            print(f"README.md:{i + 1}: '{m.group(1)}' exited {run.returncode}:\n{run.stderr}")
            failed += 1
            continue
        want = [l.rstrip() for l in body]
        got = [l.rstrip() for l in run.stdout.splitlines()]
        checked += 1
        if matches(tuple(want), tuple(got)):
            print(f"README.md:{i + 1}: the output of '{m.group(1)}' is as shown")
        else:
            failed += 1
            print(f"README.md:{i + 1}: the output of '{m.group(1)}' differs from the README "
                  f"(- README, + run; a README line '...' stands for any lines):")
            sys.stdout.writelines(difflib.unified_diff([l + "\n" for l in want],
                                                       [l + "\n" for l in got], "README.md", "run"))
    if checked == 0:
        print("no `<!-- output of: ... -->` block found in README.md")
        return 1
    return 1 if failed else 0


def snippets(args):
    lines = Path(args.readme).read_text().splitlines()
    flags = {}
    for c in args.context:
        name, _, f = c.partition("=")
        flags[name] = shlex.split(f)
    by_context = {}
    bad = 0
    for i, lang, body, marker in blocks(lines):
        if lang not in ("cpp", "c++", "cxx"):
            continue
        m = MARK_SNIPPET.match(marker or "")
        if not m:
            print(f"README.md:{i + 1}: a C++ block without `<!-- snippet: body|top CONTEXT -->`")
            bad += 1
            continue
        by_context.setdefault(m.group(2), []).append((i + 1, m.group(1), body))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for ctx, items in sorted(by_context.items()):
        if ctx not in flags:
            print(f"context '{ctx}': {len(items)} snippet(s) not compiled: its framework was not "
                  "found")
            continue
        prelude = Path(args.prelude_dir) / f"{ctx}.hpp"
        src = [f'#include "{prelude.resolve()}"\n']
        for n, (line, kind, body) in enumerate(items):
            src.append(f"// README.md line {line}\n")
            src.append(f'#line {line + 1} "README.md"\n')
            if kind == "body":
                src.append(f"namespace readme_snippet_{n} {{\n[[maybe_unused]] void run() {{\n")
                src.extend(l + "\n" for l in body)
                src.append("}\n}\n")
            else:
                src.extend(l + "\n" for l in body)
        path = work / f"readme_{ctx}.cpp"
        path.write_text("".join(src))
        cmd = [args.cxx, "-std=c++20", "-fsyntax-only", "-Werror=return-type",
               f"-I{args.include}"] + flags[ctx] + [str(path)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"context '{ctx}': the README's snippets do not compile ({path}):\n"
                  f"{run.stderr}")
            bad += 1
        else:
            print(f"context '{ctx}': {len(items)} snippet(s) compile")
    if not by_context:
        print("no C++ snippet found in README.md")
        return 1
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    o = sub.add_parser("outputs")
    o.add_argument("readme")
    o.add_argument("--exe", action="append", default=[])
    s = sub.add_parser("snippets")
    s.add_argument("readme")
    s.add_argument("--work", required=True)
    s.add_argument("--cxx", required=True)
    s.add_argument("--include", required=True)
    s.add_argument("--prelude-dir", required=True)
    s.add_argument("--context", action="append", default=[])
    a = p.parse_args()
    return outputs(a) if a.mode == "outputs" else snippets(a)


if __name__ == "__main__":
    sys.exit(main())
