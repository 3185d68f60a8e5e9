# The driver of dsec's /run_jupyter (internal/sandboxfusion/jupyter.go):
# it runs notebook cells in order in one namespace, in this one process,
# and writes what each cell did to a JSON file the handler fetches.
#
# Input, on stdin: {"cells": [str], "cell_timeout": seconds (0 = none),
# "result": file name}. Output, in that file: {"status": "Finished",
# "cells": [{"stdout", "stderr", "display": [{mime: data}], "error":
# [{"ename", "evalue", "traceback": [str]}]}]}, the shapes of
# SandboxFusion's CellRunResult and of Jupyter's messages.
#
# Like a kernel, a cell's final expression is displayed (its repr as
# text/plain, and _repr_html_ where it has one), an exception ends the
# cell but not the notebook, and input() finds no stdin. Each cell's
# sys.stdout and sys.stderr are captured apart; what a cell's child
# processes write to the inherited descriptors goes to the driver's own
# output instead.
import ast
import builtins
import io
import json
import linecache
import os
import signal
import sys
import traceback

OUTPUT_LIMIT = 1 << 20  # characters per stream and cell, as a run's output


class CellTimeoutError(BaseException):
    """Raised in a cell at its cell_timeout; not an Exception, so a cell's
    own `except Exception` does not swallow it."""


class Capture(io.TextIOBase):
    def __init__(self):
        self.parts = []
        self.size = 0

    def writable(self):
        return True

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not " + type(s).__name__)
        room = OUTPUT_LIMIT - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(len(s), room)
        return len(s)

    def value(self):
        return "".join(self.parts)


def bundle(value):
    data = {"text/plain": repr(value)}
    html = getattr(value, "_repr_html_", None)
    if callable(html):
        try:
            h = html()
            if isinstance(h, str):
                data["text/html"] = h
        except Exception:
            pass
    return data


def error_entry(exc, driver_file):
    tb = exc.__traceback__
    # Drop the driver's own frames (exec and eval here), as a kernel does.
    while tb is not None and tb.tb_frame.f_code.co_filename == driver_file:
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": lines}


def run_cell(index, source, ns, cell, timeout, driver_file):
    filename = "<cell-%d>" % index
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)

    def on_alarm(signum, frame):
        raise CellTimeoutError("cell execution timed out after %g s (cell_timeout)" % timeout)

    if timeout > 0:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        tree = ast.parse(source, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), ns)
        if last is not None:
            value = eval(compile(last, filename, "eval"), ns)
            if value is not None:
                ns["_"] = value
                cell["display"].append(bundle(value))
    except BaseException as exc:  # noqa: B036 - a cell's SystemExit is its error too
        if timeout > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
        cell["error"].append(error_entry(exc, driver_file))
    finally:
        if timeout > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)


def main():
    config = json.loads(sys.stdin.read() or "{}")
    result_path = os.path.abspath(config.get("result", "jupyter-result.json"))
    timeout = float(config.get("cell_timeout") or 0)
    driver_file = main.__code__.co_filename

    real_stdout, real_stderr, real_stdin = sys.stdout, sys.stderr, sys.stdin
    current = {}

    def display(*objs, **kwargs):
        for obj in objs:
            current["cell"]["display"].append(bundle(obj))

    ns = {"__name__": "__main__", "__builtins__": builtins, "display": display}
    cells = []
    for index, source in enumerate(config.get("cells", [])):
        cell = {"stdout": "", "stderr": "", "display": [], "error": []}
        current["cell"] = cell
        out, err = Capture(), Capture()
        sys.stdout, sys.stderr, sys.stdin = out, err, io.StringIO("")
        try:
            try:
                run_cell(index, source, ns, cell, timeout, driver_file)
            except CellTimeoutError as exc:  # fired as the cell ended
                cell["error"].append(error_entry(exc, driver_file))
        finally:
            sys.stdout, sys.stderr, sys.stdin = real_stdout, real_stderr, real_stdin
        cell["stdout"], cell["stderr"] = out.value(), err.value()
        cells.append(cell)

    tmp = result_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"status": "Finished", "cells": cells}, f)
    os.replace(tmp, result_path)


main()
