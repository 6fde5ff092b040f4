"""The sandbox's child side: the program of the interpreter that runs the code (`_child`). It reads the code
(sent ahead of stdin), sets the rlimits, installs the guard's audit hook, runs the code as __main__, reports how
it ended on the report pipe and ends with os._exit. The kernel layers are built before it starts (by bwrap, or
by grpo/sandbox/setup.py, which execve()s it), so this interpreter never loads ctypes.

These functions run in the sandboxed interpreter, not in the caller: grpo.sandbox.parent starts the interpreter
with `BOOTSTRAP` as its -c program and `program_source()` (their source) as its first argument. The functions
shipped import what they use and touch no module-level name but each other.
"""
from __future__ import annotations

import functools
import inspect

# Compiled under its own name, so that tracebacks can leave the guard's frames out.
BOOTSTRAP = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"


@functools.cache
def program_source() -> str:
    """The -c program: these functions' source (the child's interpreter runs without grpo on its path)."""
    return "from __future__ import annotations\n" + "\n".join(
        inspect.getsource(f) for f in (_make_guard, _child))


def _make_guard(root: str, readable: tuple, unreadable: tuple, report_fd: int, pid: int, lost: int = 86):
    """The audit hook of the guard. Everything it uses is a default argument or a literal (no global or builtin
    name is looked up at call time, no closure), and every container it holds is immutable, so code that
    patches builtins or modules, or even gets hold of the hook, cannot change what it does; it never calls into
    objects the code could have defined (paths must be str or bytes).

    A refusal is written to the report pipe (`report_fd`), so that catching the PermissionError does not hide
    it. If that descriptor is no longer the pipe it was (closed, or another file put in its place) or the line
    cannot be written whole, the process ends at once with status `lost`: a refusal is never lost."""
    import posix

    channel = (posix.fstat(report_fd)[2], posix.fstat(report_fd)[1])  # st_dev, st_ino of the report pipe

    def refuse(reason, report_fd=report_fd, channel=channel, lost=lost, write=posix.write, fstat=posix.fstat,
               exit=posix._exit, item=tuple.__getitem__, encode=str.encode, len=len, OSError=OSError,
               PermissionError=PermissionError):
        line = encode("\nblocked " + reason[:1000] + "\n")  # on a line of its own, whatever was written before
        try:
            st = fstat(report_fd)
            if (item(st, 2), item(st, 1)) != channel or write(report_fd, line) != len(line):
                exit(lost)
        except OSError:
            exit(lost)
        raise PermissionError("sandbox: " + reason)

    def resolve(path, root=root, str=str, bytes=bytes, int=int, type=type, issubclass=issubclass,
                as_str=str.__str__, decode=bytes.decode):
        """An absolute, normalised str path (relative ones are taken from `root`, the only working directory
        allowed); an int (a file descriptor) or None as is; False for anything else."""
        kind = type(path)
        if kind is int or path is None:
            return path
        if kind is not str:
            if issubclass(kind, str):
                path = as_str(path)
            elif issubclass(kind, bytes):
                path = decode(path, "utf-8", "surrogateescape")
            else:
                return False
        if not path.startswith("/"):
            path = root + "/" + path
        parts = []
        for seg in path.split("/"):
            if seg == "..":
                if parts:
                    parts.pop()
            elif seg and seg != ".":
                parts.append(seg)
        return "/" + "/".join(parts)

    def inside(path, dirs):
        for d in dirs:
            if path == d or path.startswith(d + "/"):
                return True
        return False

    def file_type(path, stat=posix.stat, item=tuple.__getitem__, OSError=OSError, ValueError=ValueError):
        try:
            return item(stat(path), 0) & 0o170000  # st_mode (os.stat_result's attributes can be patched)
        except (OSError, ValueError):
            return 0

    def audit(event, args, root=(root,), readable=readable, unreadable=unreadable, pid=pid,
              refuse=refuse, resolve=resolve, inside=inside, file_type=file_type, function=type(refuse), type=type,
              str=str, int=int,
              issubclass=issubclass, as_str=str.__str__,
              write_flags=posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND,
              devices_read=frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/stdin"}),
              devices_write=frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"}),
              process=frozenset({"os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system",
                                 "os.startfile", "subprocess.Popen"}),
              listing=frozenset({"os.listdir", "os.scandir", "os.listxattr", "os.getxattr"}),
              changing=frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown",
                                  "os.utime", "os.truncate", "os.setxattr", "os.removexattr", "os.chflags",
                                  "os.lchflags", "os.lchmod"}),
              introspection=frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents",
                                       "sys._current_frames"}),
              frozen_attrs=frozenset({"__code__", "__defaults__", "__kwdefaults__"}),
              modules=frozenset({
                  "ctypes", "_ctypes", "socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess",
                  "multiprocessing", "_multiprocessing", "_posixshmem", "mmap", "resource", "pty", "termios",
                  "gc", "posix", "_signal", "_imp", "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_testcapi",
                  "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testimportmultiple",
                  "_testsinglephase", "_testclinic", "_ctypes_test", "_xxtestfuzz", "xxlimited", "xxlimited_35",
                  "sqlite3", "_sqlite3", "_dbm", "_gdbm", "syslog", "spwd", "ossaudiodev", "_tkinter",
                  "readline", "_curses", "_curses_panel"})):
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            p = resolve(path)
            if p is False:
                refuse("file paths must be str or bytes")
            if p is None or type(p) is int:
                return  # a descriptor it already has
            writing = (type(flags) is int and flags & write_flags) or (
                type(mode) is str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode))
            if inside(p, root):
                kind = file_type(p)
                if kind == 0o020000 or kind == 0o060000:
                    refuse("opening the device " + p + " is not allowed")
                return
            if writing:
                if p in devices_write:
                    return
                refuse("writing " + p + " is not allowed: only the working directory is writable")
            if p in devices_read:
                return
            if inside(p, readable) and not inside(p, unreadable):
                if file_type(p) == 0o040000:  # a directory descriptor would make relative paths escape
                    refuse("opening the directory " + p + " is not allowed")
                return
            refuse("reading " + p + " is not allowed: only the working directory and the standard library "
                   "are readable")
        elif event == "import":
            name = args[0]
            if type(name) is not str:
                name = as_str(name) if issubclass(type(name), str) else ""
            for part in name.split("."):
                if part in modules:
                    refuse("importing " + name + " is not allowed")
            if args[1] is not None:  # an extension module's file (_imp.create_dynamic): only the stdlib's
                p = resolve(args[1])
                if type(p) is not str or not inside(p, readable) or inside(p, unreadable):
                    refuse("loading native code from outside the standard library is not allowed")
        elif event in process:
            refuse("starting a process is not allowed")
        elif event == "os.kill":
            if not (type(args[0]) is int and args[0] == pid):
                refuse("sending a signal to another process is not allowed")
        elif event == "os.killpg":
            refuse("sending a signal to a process group is not allowed")
        elif event.startswith("socket."):
            refuse("network access is not allowed")
        elif event.startswith("ctypes."):
            refuse("ctypes is not allowed")
        elif event.startswith("resource."):
            refuse("changing resource limits is not allowed")
        elif event in introspection:
            refuse("inspecting the interpreter's objects is not allowed")
        elif event == "cpython.PyInterpreterState_New":
            refuse("sub-interpreters are not allowed")
        elif event == "sys.addaudithook":  # a hook of the code's own would outlive the guard's at shutdown
            refuse("adding audit hooks is not allowed")
        elif event == "object.__setattr__":
            name = args[1]
            if type(name) is not str:
                name = as_str(name) if issubclass(type(name), str) else ""
            if name in frozen_attrs and type(args[0]) is function and args[0].__code__.co_filename == "<sandbox>":
                refuse("changing the sandbox's functions is not allowed")
        elif event == "os.link" or event == "os.symlink":
            refuse("creating links is not allowed")
        elif event == "os.chdir":
            if resolve(args[0]) != root[0]:
                refuse("changing the working directory is not allowed")
        elif event in listing:
            p = resolve(args[0])
            if p is False:
                refuse("file paths must be str or bytes")
            if p is None or type(p) is int or inside(p, root) or (inside(p, readable)
                                                                  and not inside(p, unreadable)):
                return
            refuse("listing " + p + " is not allowed: only the working directory and the standard library "
                   "are readable")
        elif event in changing:
            for i in ((0, 1) if event == "os.rename" else (0,)):
                p = resolve(args[i])
                if type(p) is int and event == "os.truncate":
                    continue  # truncating needs a descriptor open for writing, hence inside the directory
                if type(p) is not str:
                    refuse("changing files through a descriptor or a non-str path is not allowed")
                if not inside(p, root):
                    refuse("changing " + p + " is not allowed: only the working directory is writable")

    return audit


def _child(config: dict) -> None:
    """The sandboxed interpreter's program: read the code (sent ahead of stdin), set the rlimits, install the
    guard, run the code as __main__ and report how it ended on the report pipe ("blocked <reason>", "memory",
    "exit <status>"). It ends with os._exit after flushing: the interpreter's own shutdown, which clears the audit
    hooks before it finalises the objects left, never runs."""
    import os
    import sys

    report, lost = config["report_fd"], config["lost_status"]
    # Kept here: the code may replace the module's functions, or os.stat_result's attributes.
    write, fstat, exit_, item = os.write, os.fstat, os._exit, tuple.__getitem__
    channel = (item(fstat(report), 2), item(fstat(report), 1))  # st_dev, st_ino of the report pipe

    def say(line):
        try:
            write(report, ("\n" + line + "\n").encode())
        except OSError:
            pass

    chunks, left = [], config["program_bytes"]
    while left:
        chunk = os.read(0, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    source = b"".join(chunks).decode("utf-8", "replace")
    os.chdir(config["root"])

    import resource
    mb = 1 << 20
    limits = [(resource.RLIMIT_AS, config["memory_mb"] * mb), (resource.RLIMIT_CPU, config["cpu_s"]),
              (resource.RLIMIT_FSIZE, config["file_mb"] * mb), (resource.RLIMIT_NOFILE, 64),
              (resource.RLIMIT_CORE, 0)]
    if config["nproc"]:  # counted per user namespace; outside one it would count the caller's processes too
        limits.append((resource.RLIMIT_NPROC, 64))
    for which, soft in limits:
        # The CPU hard limit one second later: SIGXCPU first, then SIGKILL if the code ignores that.
        hard = soft + 1 if which == resource.RLIMIT_CPU else soft
        old_hard = resource.getrlimit(which)[1]
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))
    del resource

    if config["watchdog"]:  # without the namespaces' monitor: this also ends a child whose caller died
        import _thread
        import time

        def watchdog(seconds=config["deadline_s"], sleep=time.sleep, exit=exit_):
            sleep(seconds)
            exit(137)

        _thread.start_new_thread(watchdog, ())

    import linecache
    import signal
    import traceback
    for name in list(sys.modules):  # what only the setup needed: imported again, the guard would refuse it
        if name.split(".")[0] == "resource":
            del sys.modules[name]
    # Builtin modules are imported now, and _imp.create_builtin deleted: it would make fresh copies of posix
    # and _signal, with the functions deleted below; the guard refuses importing them again from elsewhere.
    import warnings
    with warnings.catch_warnings():  # a deprecated builtin module (spwd in some builds) would warn on stderr
        warnings.simplefilter("ignore")
        for name in sys.builtin_module_names:
            if name != "gc":
                __import__(name)
    del sys.modules["_imp"].create_builtin
    for module in (os, sys.modules["posix"], signal, sys.modules["_signal"], sys.modules["time"]):
        for name in ("pidfd_open", "pidfd_send_signal", "setpriority", "sched_setaffinity", "sched_setscheduler",
                     "sched_setparam", "mknod", "mkfifo", "chroot", "setns", "unshare", "clock_settime",
                     "clock_settime_ns", "memfd_create"):
            function = getattr(module, name, None)
            if function is not None:
                delattr(module, name)
                for functions in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks):
                    functions.discard(function)  # these sets would hand them back
    if config["guard"]:
        readable = tuple(sorted({os.path.realpath(p) for p in sys.path if os.path.exists(p)}))
        unreadable = tuple(p + "/" + s for p in readable for s in ("site-packages", "dist-packages"))
        sys.addaudithook(_make_guard(config["root"], readable, unreadable, report, os.getpid(), lost))

    def print_traceback(e):
        """As the interpreter prints it, without the frames of this program and of the guard."""
        top = traceback.TracebackException(type(e), e, e.__traceback__)
        todo, seen = [top], set()
        while todo:
            te = todo.pop()
            if id(te) not in seen:
                seen.add(id(te))
                te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != "<sandbox>"])
                todo += [x for x in (te.__cause__, te.__context__) if x is not None]
        sys.stderr.write("".join(top.format()))

    def unraisable(u):
        """An exception the interpreter can only report (in an atexit function, a __del__…), printed as it would
        print it but from linecache: its own printer opens the source files along sys.path, which the guard
        would refuse (and count as a refusal of the code's)."""
        try:
            sys.stderr.write(f"{u.err_msg or 'Exception ignored in'}: {u.object!r}\n")
            print_traceback(u.exc_value)
        except BaseException:
            pass

    sys.unraisablehook = unraisable

    def exit_status(e):
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1

    main = type(sys)("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    sys.stdout.reconfigure(line_buffering=True)  # what was printed before a timeout is not lost
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    status = 0
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit as e:
        status = exit_status(e)
    except BaseException as e:
        status = 1
        if isinstance(e, MemoryError):
            say("memory")
            main.__dict__.clear()  # room to print the traceback
        try:
            print_traceback(e)
        except BaseException:
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
    # What the interpreter's shutdown would do while the audit hooks still hold (waiting for the code's threads,
    # its atexit functions), still guarded; then os._exit, so that nothing runs after the hooks are gone.
    for finish in ("threading", "atexit"):
        try:
            if finish == "threading" and "threading" in sys.modules:
                sys.modules["threading"]._shutdown()
            elif finish == "atexit":
                import atexit
                atexit._run_exitfuncs()
        except SystemExit as e:
            status = exit_status(e)
        except BaseException:
            pass
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = status or 120  # as the interpreter does when it cannot flush
    try:
        st = fstat(report)
        intact = (item(st, 2), item(st, 1)) == channel
    except OSError:
        intact = False
    if not intact:  # the code closed or replaced the report pipe: the run counts as failed
        exit_(lost + 1)
    say(f"exit {status}")
    exit_(status)
