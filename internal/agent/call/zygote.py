# The warm Python interpreter of a fncall container (package call).
#
# The agent starts this once, as root, with a SOCK_SEQPACKET socket as fd 9
# and the modules to import first in DSEC_ZYGOTE_PRELOAD. For every run the
# agent sends one message: a JSON header and, as SCM_RIGHTS, the run's
# stdin, stdout and stderr followed by the cgroup v1 tasks files it must
# start in. The zygote forks; the child joins those cgroups, starts a new
# session, takes the stdio fds, closes every other fd, drops to the run's
# uid and gid, changes into its scratch directory, and runs the file as
# `python3 FILE` would (as __main__, argv [FILE], its directory first on
# sys.path), then exits with the code python3 would. The zygote answers
# {"pid": N} at once and {"exit": N, "status": WAITSTATUS} when the child
# is reaped. It never starts a thread: a fork must not copy a held lock.
import gc
import json
import os
import socket
import sys

CTRL_FD = 9
MAX_FDS = 16


def preload():
    for name in os.environ.get("DSEC_ZYGOTE_PRELOAD", "").split(","):
        name = name.strip()
        if not name:
            continue
        try:
            __import__(name)
        except Exception as e:  # a missing module costs its calls a slower import, nothing more
            print("zygote: preload %s: %s" % (name, e), file=sys.stderr, flush=True)


def child(hdr, fds):
    # Every failure before the code runs exits 127, as a shell does for a
    # command it could not start; the message goes to the run's stderr.
    try:
        import signal
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for fd in fds[3:]:
            os.write(fd, b"0")
        for i in range(3):
            os.dup2(fds[i], i)
        os.closerange(3, 1 << 16)
        gid, uid = hdr["gid"], hdr["uid"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError("could not drop to uid %d" % uid)
        os.umask(0o022)
        os.chdir(hdr["cwd"])
        os.environ.clear()
        os.environ.update(hdr.get("env") or {})
        # sys.stdin, stdout and stderr stay the zygote's: they read and
        # write fds 0, 1 and 2, now the run's, with the buffering and
        # encoding python3 gives pipes (the zygote never wrote to them).
        # python3 FILE: argv[0] as given, __file__ and tracebacks absolute,
        # the script's directory first on sys.path (-I left it off).
        sys.argv = [hdr["file"]]
        path = os.path.abspath(hdr["file"])
        sys.path.insert(0, os.path.dirname(path))
    except BaseException as e:
        try:
            os.write(2, ("zygote: could not start the run: %s\n" % e).encode())
        finally:
            os._exit(127)
    code = 0
    try:
        gc.enable()
        run_main(path)
    except SystemExit as e:
        code = exit_code(e)
    except BaseException as e:
        # The traceback python3 prints: from the file's own frames on,
        # not the zygote's (none at all for a syntax error).
        import traceback
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        code = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            # python3 reports a failed final flush and exits 120.
            code = code or 120
    os._exit(code)


def run_main(path):
    # What `python3 FILE` does: compile the file and run it as a fresh
    # __main__ module (runpy.run_path would first probe FILE as a zip).
    import types
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec")
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    main.__cached__ = None
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def exit_code(e):
    c = e.code
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    try:
        print(c, file=sys.stderr)
    except BaseException:
        pass
    return 1


def main():
    preload()
    # Objects made so far are never collected: a child's collector then
    # leaves their pages alone instead of copying them on write. The
    # zygote itself makes little garbage, and children enable collection.
    gc.disable()
    gc.freeze()
    ctrl = socket.socket(fileno=CTRL_FD)
    children = {}
    ctrl.setblocking(True)
    import selectors
    import signal

    # SIGCHLD wakes the loop through a pipe; the loop reaps.
    rd, wr = os.pipe()
    os.set_blocking(wr, False)
    os.set_inheritable(rd, False)
    os.set_inheritable(wr, False)
    signal.set_wakeup_fd(wr)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(ctrl, selectors.EVENT_READ)
    sel.register(rd, selectors.EVENT_READ)
    print("zygote: ready", file=sys.stderr, flush=True)
    while True:
        for key, _ in sel.select():
            if key.fileobj is ctrl:
                msg, fds, _, _ = socket.recv_fds(ctrl, 1 << 20, MAX_FDS)
                if not msg:
                    return  # the agent closed its end
                try:
                    hdr = json.loads(msg)
                    if len(fds) < 3:
                        raise ValueError("want stdin, stdout and stderr, got %d fds" % len(fds))
                    pid = os.fork()
                except BaseException as e:
                    for fd in fds:
                        os.close(fd)
                    ctrl.send(json.dumps({"error": str(e)}).encode())
                    continue
                if pid == 0:
                    ctrl.close()
                    child(hdr, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = True
                ctrl.send(json.dumps({"pid": pid}).encode())
            else:
                try:
                    os.read(rd, 4096)
                except BlockingIOError:
                    pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.pop(pid, None)
            ctrl.send(json.dumps({"exit": pid, "status": status}).encode())


if __name__ == "__main__":
    main()
