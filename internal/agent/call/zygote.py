# The warm Python interpreter of a fncall container (package call).
#
# The agent starts this once, as root, with a SOCK_SEQPACKET socket as fd 9
# and the modules to import first, comma-separated, as its one argument;
# its environment is the calls' usual one but HOME. For every run the
# agent sends one message: a header (header() below) and, as SCM_RIGHTS, the run's
# stdin, stdout and stderr followed by the cgroup v1 tasks files it must
# start in. The zygote forks; the child joins those cgroups, starts a new
# session, takes the stdio fds, closes every other fd, lowers RLIMIT_DATA
# to the run's memory limit, drops to the run's uid and gid, changes into
# its scratch directory, and runs the file as `python3 FILE` would (as
# __main__, argv [FILE], its directory first on sys.path), then exits
# with the code python3 would. The zygote answers
# {"pid": N} at once and {"exit": N, "status": WAITSTATUS} when the child
# is reaped. It never starts a thread: a fork must not copy a held lock.
import gc
import json
import os
import resource
import socket
import sys

CTRL_FD = 9
MAX_FDS = 16


def preload():
    for name in (sys.argv[1] if len(sys.argv) > 1 else "").split(","):
        name = name.strip()
        if not name:
            continue
        try:
            __import__(name)
        except Exception as e:  # a missing module costs its calls a slower import, nothing more
            print("zygote: preload %s: %s" % (name, e), file=sys.stderr, flush=True)


def header(msg):
    # FILE, CWD, UID, GID, DATA (the run's RLIMIT_DATA in bytes, 0 for
    # none), then the environment's names and values, each ended by a
    # NUL: fewer objects to make than JSON's, and every object a child
    # makes may land on a page it must copy.
    f = msg.decode("utf-8", "surrogateescape").split("\0")
    return f[0], f[1], int(f[2]), int(f[3]), int(f[4]), zip(f[5:-1:2], f[6:-1:2])


def child(msg, fds):
    # Every failure before the code runs exits 127, as a shell does for a
    # command it could not start; the message goes to the run's stderr.
    try:
        file, cwd, uid, gid, data, env = header(msg)
        os.setsid()
        for fd in fds[3:]:
            os.write(fd, b"0")
        for i in range(3):
            os.dup2(fds[i], i)
        os.closerange(3, 1 << 16)
        if data > 0:
            # Soft and hard alike, so the run cannot raise it again.
            resource.setrlimit(resource.RLIMIT_DATA, (data, data))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError("could not drop to uid %d" % uid)
        os.umask(0o022)
        os.chdir(cwd)
        replace_env(env)
        # sys.stdin, stdout and stderr stay the zygote's: they read and
        # write fds 0, 1 and 2, now the run's, with the buffering and
        # encoding python3 gives pipes (the zygote never wrote to them).
        # python3 FILE: argv[0] as given, __file__ and tracebacks absolute,
        # the script's directory first on sys.path (-I left it off).
        sys.argv = [file]
        path = os.path.abspath(file)
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


def replace_env(env):
    # The zygote's environment is what most calls get but HOME, so a run
    # changes a variable or two: every variable set or unset is a C
    # setenv and objects made, each landing on a page copied on write.
    want = dict(env)
    for k in ZYGOTE_ENV:
        if k not in want:
            del os.environ[k]
    for k, v in want.items():
        if ZYGOTE_ENV.get(k) != v:
            os.environ[k] = v


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


def warm():
    # Python 3.11+ rewrites a function's bytecode in place as it runs
    # (quickening after a few calls, then specialising each instruction),
    # so code a child runs for the first time writes to the zygote's
    # pages, each a copy on write per run. What every child runs (the
    # header's decoding, the environment's replacement, the path
    # functions, compiling and running a module, the random module's
    # reseed after fork) runs here first, until it has settled.
    import types
    hdr = b"/w/main.py\0/w\x001\x001\x000\0HOME\0/w\0"
    for k, v in ZYGOTE_ENV.items():
        hdr += b"%s\0%s\0" % (k.encode(), v.encode())
    seed = getattr(sys.modules.get("random"), "seed", None)
    for _ in range(64):
        file, _, _, _, _, env = header(hdr)
        replace_env(env)
        replace_env(ZYGOTE_ENV.items())
        path = os.path.abspath(file)
        os.path.dirname(path)
        main = types.ModuleType("__warm__")
        main.__builtins__ = __builtins__
        exec(compile("x = 1\n", path, "exec"), main.__dict__)
        if seed is not None:
            seed()


# The environment the zygote started with, which replace_env compares to.
ZYGOTE_ENV = dict(os.environ)


def main():
    preload()
    warm()
    # Objects made so far are never collected: a child's collector then
    # leaves their pages alone instead of copying them on write. The
    # zygote itself makes little garbage, and children enable collection.
    gc.disable()
    gc.freeze()
    ctrl = socket.socket(fileno=CTRL_FD)
    ctrl.setblocking(True)
    import select

    # A child's exit wakes the loop through its pidfd, so the zygote
    # needs no SIGCHLD handler and its children no signal to reset.
    poller = select.poll()
    poller.register(CTRL_FD, select.POLLIN)
    children = {}  # pidfd: pid
    print("zygote: ready", file=sys.stderr, flush=True)
    # Every page this loop writes is copied on write (or at least
    # faulted) once per fork, so it does as little as it can: the child
    # decodes the header, and the replies are formatted bytes.
    while True:
        for fd, _ in poller.poll():
            if fd != CTRL_FD:
                pid = children.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                ctrl.send(b'{"exit":%d,"status":%d}' % (pid, status))
                continue
            msg, fds, _, _ = socket.recv_fds(ctrl, 1 << 20, MAX_FDS)
            if not msg:
                return  # the agent closed its end
            try:
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
                child(msg, fds)
            for fd in fds:
                os.close(fd)
            try:
                pidfd = os.pidfd_open(pid)
            except OSError as e:
                # Without its pidfd the run's end would go unseen.
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                ctrl.send(json.dumps({"error": "watch the run: %s" % e}).encode())
                continue
            poller.register(pidfd, select.POLLIN)
            children[pidfd] = pid
            ctrl.send(b'{"pid":%d}' % pid)


if __name__ == "__main__":
    main()
