"""The kit's local channels are its user's alone (issue #47; docs/design/launching.md, "Local
channels"): the launcher's output socket, ``axolotl-dist where``'s run records and the
launcher's own files. Another user is played by a real process running as ``nobody`` (the
tests need root to start one; they are skipped otherwise): it cannot reach the socket, list
the directories or read the files, and a line it gets into the socket anyway (the directory
opened to it on purpose) is not printed as a rank's."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from fixtures import finish, start, subprocess_env
from strangers import as_nobody, intruder_python, other_user

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="playing another user needs root on Linux"),
    pytest.mark.timeout(150),
]

TIMEOUT = 90

#: Rank 0 leaves the output socket's path in ``socket_path``; every rank waits for a file
#: ``go`` (at most ``argv[1]`` seconds) before it ends.
SLEEPER = """
import os, sys, time
import axolotl_dist as ad
ad.init_distributed()
r = ad.get_rank()
if r == 0:
    with open("master_port", "w") as fh:
        fh.write(os.environ["MASTER_PORT"])
    with open("socket_path.tmp", "w") as fh:
        fh.write(os.environ.get("AXOLOTL_DIST_LAUNCHER_FOLDS", ""))
    os.replace("socket_path.tmp", "socket_path")
sys.stdout.write(f"started {r}\\n"); sys.stdout.flush()
end = time.monotonic() + float(sys.argv[1])
while not os.path.exists("go") and time.monotonic() < end:
    time.sleep(0.05)
ad.barrier()
sys.stdout.write(f"done {r}\\n"); sys.stdout.flush()
"""

#: Run as the other user: each argument ``action=path``; prints what each got (JSON).
INTRUDER = r"""
import json, os, socket, sys, time
def inject(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    try:  # a rank's header, then a line that would read as rank 0's
        sock.sendall(b"0 1 0\n[rank 0] INJECTED by another user\n")
        time.sleep(0.3)
        sock.sendall(b"INJECTED again\n")
    except OSError:
        pass
    sock.close()
    return "connected"
def plant(path):
    os.mkdir(path)
    os.chmod(path, 0o777)
    return "made"
ACTIONS = {"connect": inject, "list": lambda p: sorted(os.listdir(p)), "plant": plant,
           "read": lambda p: open(p, "rb").read().decode(errors="replace"),
           "link": lambda p: (os.symlink("/", p), "made")[1]}
found = {}
for arg in sys.argv[1:]:
    action, _, path = arg.partition("=")
    try:
        found[arg] = ACTIONS[action](path)
    except OSError as exc:
        found[arg] = type(exc).__name__
print(json.dumps(found))
"""


def as_other_user(*actions: str) -> Dict[str, object]:
    """Run :data:`INTRUDER` as ``nobody`` (no supplementary groups): what each action got."""
    done = as_nobody(intruder_python(), "-c", INTRUDER, *actions)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen,
              seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not ready():
        if proc.poll() is not None or time.monotonic() > end:
            code, out, err = finish(proc, 10)
            pytest.fail(f"no {what} (exit {code}):\n{out}\n{err[-3000:]}")
        time.sleep(0.05)


def _launch(tmp_path: Path, env: Dict[str, str], seconds: float = 30) -> subprocess.Popen:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    return start([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", "sleeper.py",
                  str(seconds)], env, cwd=tmp_path)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _owned(path: str) -> bool:
    return os.lstat(path).st_uid == os.geteuid()


@pytest.fixture
def shared_tmp():
    """A temporary directory like ``/tmp`` (mode 1777) that other users can reach, for the
    runs' ``TMPDIR``."""
    made = tempfile.mkdtemp(prefix="axd_chan_", dir="/tmp")
    os.chmod(made, 0o1777)
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def _env(tmp_path: Path, tmp: str, **extra: str) -> Dict[str, str]:
    """The runs' env: their ``TMPDIR`` is ``tmp``; the run directory is the default one."""
    extra.setdefault("XDG_CACHE_HOME", str(tmp_path / "cache"))
    env = subprocess_env(tmp_path, TMPDIR=tmp, **extra)
    env.pop("AXOLOTL_DIST_RUN_DIR", None)
    if "XDG_RUNTIME_DIR" not in extra:
        env.pop("XDG_RUNTIME_DIR", None)
    return env


def _abstract_names(pid: int) -> List[str]:
    """Abstract Unix socket names of this host that name ``pid`` (the old channel did)."""
    with open("/proc/net/unix") as fh:
        return [line for line in fh if "@" in line and f"-{pid}-" in line]


def test_another_user_cannot_reach_the_output_socket(tmp_path, shared_tmp):
    proc = _launch(tmp_path, _env(tmp_path, shared_tmp))
    try:
        _wait_for("socket path from rank 0", (tmp_path / "socket_path").exists, proc)
        path = (tmp_path / "socket_path").read_text()
        folder = os.path.dirname(path)
        assert os.path.dirname(folder) == shared_tmp, path  # the launcher's own directory
        assert stat.S_ISSOCK(os.lstat(path).st_mode), path
        assert (_mode(path), _owned(path)) == (0o600, True), path
        assert (_mode(folder), _owned(folder)) == (0o700, True), folder
        assert _abstract_names(proc.pid) == []  # no name without permission checks
        got = as_other_user(f"connect={path}", f"list={folder}")
        assert got == {f"connect={path}": "PermissionError",
                       f"list={folder}": "PermissionError"}, got
    finally:
        (tmp_path / "go").write_text("")
        code, out, err = finish(proc, TIMEOUT)
    assert code == 0, (out, err)
    assert "INJECTED" not in out + err, (out, err)
    assert "[rank 0] done 0" in out and "[rank 1] done 1" in out, out


def test_a_connection_of_another_user_is_closed_unread(tmp_path, shared_tmp):
    # the directory opened to the other user on purpose: the launcher checks who connected
    proc = _launch(tmp_path, _env(tmp_path, shared_tmp))
    try:
        _wait_for("socket path from rank 0", (tmp_path / "socket_path").exists, proc)
        path = (tmp_path / "socket_path").read_text()
        os.chmod(os.path.dirname(path), 0o711)
        os.chmod(path, 0o666)
        got = as_other_user(f"connect={path}", f"connect={path}")  # said once, not twice
        assert got == {f"connect={path}": "connected"}, got
        time.sleep(0.5)  # the launcher had time to show a line it would have shown
    finally:
        (tmp_path / "go").write_text("")
        code, out, err = finish(proc, TIMEOUT)
    assert code == 0, (out, err)
    assert "INJECTED" not in out + err, (out, err)
    uid = other_user().pw_uid
    note = (f"axolotl-dist: closed a connection to the ranks' output socket from uid {uid}, "
            f"not this run's user (uid {os.geteuid()}); nothing it sent is shown\n")
    assert err.count(note) == 1, err
    assert "[rank 0] done 0" in out and "[rank 1] done 1" in out, out


@pytest.mark.parametrize("where", ["tmp", "xdg"])
def test_run_records_and_the_launchers_files_are_this_users_alone(tmp_path, shared_tmp, where):
    extra = {}
    if where == "xdg":
        xdg = tempfile.mkdtemp(dir=shared_tmp)  # like /run/user/<uid>: 0700, the user's
        extra["XDG_RUNTIME_DIR"] = xdg
        base = os.path.join(xdg, "axolotl_dist")
    else:
        base = os.path.join(shared_tmp, f"axolotl_dist-{os.geteuid()}")
    runs = os.path.join(base, "runs")
    proc = _launch(tmp_path, _env(tmp_path, shared_tmp, **extra))
    try:
        _wait_for("run record", lambda: os.path.isdir(runs) and any(
            n.endswith(".json") for n in os.listdir(runs)), proc)
        _wait_for("socket path from rank 0", (tmp_path / "socket_path").exists, proc)
        record = os.path.join(runs, next(n for n in os.listdir(runs) if n.endswith(".json")))
        launcher = os.path.dirname((tmp_path / "socket_path").read_text())
        attempt = os.path.join(launcher, "ends", "0")
        note = os.path.join(attempt, "store.json")
        guards = os.path.join(attempt, "guards")
        _wait_for("guard notes", lambda: os.path.isdir(guards) and len(os.listdir(guards)) == 2,
                  proc)
        dirs = [base, runs, launcher, os.path.dirname(attempt), attempt, guards]
        files = [record, note] + [os.path.join(guards, n) for n in os.listdir(guards)]
        assert {p: (_mode(p), _owned(p)) for p in dirs} == {p: (0o700, True) for p in dirs}
        assert {p: (_mode(p), _owned(p)) for p in files} == {p: (0o600, True) for p in files}
        assert json.loads(Path(record).read_text())["pid"] == proc.pid
        asked = [f"list={base}", f"list={runs}", f"read={record}", f"list={launcher}",
                 f"read={note}"]
        got = as_other_user(*asked)
        assert got == {a: "PermissionError" for a in asked}, got
    finally:
        (tmp_path / "go").write_text("")
        code, out, err = finish(proc, TIMEOUT)
    assert code == 0, (out, err)
    assert os.listdir(runs) == []  # the launcher took its record back


@pytest.mark.parametrize("planted", ["another user's", "writable by others", "a link"])
def test_a_squatted_run_directory_gives_way_to_a_private_one(tmp_path, shared_tmp, planted):
    base = os.path.join(shared_tmp, f"axolotl_dist-{os.geteuid()}")
    if planted == "writable by others":
        os.mkdir(base)
        os.chmod(base, 0o777)
        why = "is writable by other users (mode 777)"
    else:
        action = "plant" if planted == "another user's" else "link"
        assert as_other_user(f"{action}={base}") == {f"{action}={base}": "made"}
        why = (f"belongs to uid {other_user().pw_uid}, not to this user (uid {os.geteuid()})"
               if planted == "another user's" else "is a link or not a directory")
    env = _env(tmp_path, shared_tmp)
    fallback = os.path.join(env["XDG_CACHE_HOME"], "axolotl_dist",
                            f"runs-{socket.gethostname()}")
    proc = _launch(tmp_path, env)
    try:
        _wait_for("run record in the fallback", lambda: os.path.isdir(fallback) and any(
            n.endswith(".json") for n in os.listdir(fallback)), proc)
        assert (_mode(fallback), _owned(fallback)) == (0o700, True)
        where = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "where"],
                               env=env, capture_output=True, text=True, timeout=60,
                               cwd=str(tmp_path))
    finally:
        (tmp_path / "go").write_text("")
        code, out, err = finish(proc, TIMEOUT)
    assert code == 0, (out, err)
    said = (f"axolotl-dist: {base} {why}: the kit keeps a run's files only in a directory "
            f"that is this user's alone; ")
    assert err.count(said) == 1, err
    assert f"the kit records this user's runs in {fallback} instead" in err, err
    if planted != "a link":
        assert os.listdir(base) == []  # nothing written into it
    assert where.returncode == 0, where
    assert "where every rank of the run at 127.0.0.1:" in where.stdout, where.stdout
    assert "ranks 0, 1: in <module> at sleeper.py:" in where.stdout, where.stdout
    assert where.stderr.count(f"axolotl-dist where: {base} {why}: ") == 1, where.stderr
    assert os.listdir(fallback) == []  # the launcher took its record back


#: ``axolotl-dist where`` as another user: the kit and torch imported as root (the other user
#: cannot read this Python's install), then every privilege dropped before it runs.
WHERE_AS = """
import encodings.idna, os, socket, sys
from axolotl_dist.launch import main
socket.getaddrinfo("127.0.0.1", 1)  # the resolver's modules, while they can be read
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
os.chdir("/")
sys.exit(main(["where", *sys.argv[3:]]))
"""


def where_as_other_user(env: Dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``axolotl-dist where ARGS`` run by ``nobody`` (:data:`WHERE_AS`)."""
    who = other_user()
    return subprocess.run([sys.executable, "-c", WHERE_AS, str(who.pw_uid), str(who.pw_gid),
                           *args], env=env, capture_output=True, text=True, timeout=60)


def test_another_users_where_makes_nothing(tmp_path, shared_tmp):
    env = dict(_env(tmp_path, shared_tmp), HOME="/nonexistent")
    env.pop("XDG_CACHE_HOME")
    done = where_as_other_user(env)
    assert done.returncode == 1, done
    assert "no run of this user is recorded on this host" in done.stderr, done.stderr
    assert os.listdir(shared_tmp) == []  # neither its own directory nor anyone else's


def test_a_one_node_runs_store_listens_on_loopback_only(tmp_path, shared_tmp):
    others = _external_addresses()
    if not others:
        pytest.skip("this host has no address but loopback")
    proc = _launch(tmp_path, _env(tmp_path, shared_tmp))
    try:
        _wait_for("socket path from rank 0", (tmp_path / "socket_path").exists, proc)
        ports = _listening(proc.pid)
        assert len(ports) == 2, ports  # the rendezvous' store and the ranks'
        for port in ports:
            for addr in others:
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((addr, port), timeout=5)
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        (tmp_path / "go").write_text("")
        code, out, err = finish(proc, TIMEOUT)
    assert code == 0, (out, err)


def _external_addresses() -> List[str]:
    """This host's IPv4 addresses other than loopback."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    found = [line.split()[3].split("/")[0] for line in out.splitlines() if " inet " in line]
    return [a for a in found if not a.startswith("127.")]


def _listening(pid: int) -> List[int]:
    """The TCP ports process ``pid`` listens on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return sorted(int(line.split()[3].rpartition(":")[2]) for line in out.splitlines()
                  if f"pid={pid}," in line)


def test_a_strangers_where_gets_no_stacks(tmp_path, shared_tmp):
    env = _env(tmp_path, shared_tmp)
    proc = _launch(tmp_path, env)
    try:
        _wait_for("socket path from rank 0", (tmp_path / "socket_path").exists, proc)
        port = (tmp_path / "master_port").read_text()
        stranger = dict(env, HOME="/nonexistent")
        stranger.pop("XDG_CACHE_HOME")
        theirs = where_as_other_user(stranger, "--master-port", port, "--timeout", "10")
        mine = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "where"], env=env,
                              capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        stored = _every_value(int(port))
    finally:
        (tmp_path / "go").write_text("")
        code, out, err = finish(proc, TIMEOUT)
    assert code == 0, (out, err)
    assert "sleeper.py" not in theirs.stdout + theirs.stderr, theirs
    assert "sealed with a run secret this process does not have" in theirs.stdout, theirs
    assert "ranks 0, 1: in <module> at sleeper.py:" in mine.stdout, mine  # the run's user
    assert "note: this run has no secret" not in mine.stdout, mine
    answers = {k: v for k, v in stored.items() if "/where/" in k}
    # each answer encrypted (the family of the kit's marks of an encrypted record, any version)
    assert len(answers) == 2 and all(v.startswith(b"\x1fe") for v in answers.values()), answers
    assert not [k for k, v in stored.items() if b"sleeper.py" in v], stored  # nowhere in clear


def _every_value(port: int) -> Dict[str, bytes]:
    """Every key of the store at ``port`` and its value (what a client of it can read)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    return {k: store.get(k) for k in store.list_keys()}
