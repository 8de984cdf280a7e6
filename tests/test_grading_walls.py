"""The grading child's walls (`autograder.walls`): bubblewrap, an allowlisted root, uid 65534, seccomp.

Each wall is tested from the outside, by running a probe exactly as the grader runs its child, and beside a
control: the same probe without the walls, which shows that what the wall stops is possible here.
The machine's CI grades as root, so these tests see the layered walls (root lays out, uid 65534 runs);
`test_the_walls_hold_for_a_grader_who_is_a_normal_user` runs them again as a normal user, whose walls are
one bubblewrap in user namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from autograder import seccomp, walls
from autograder.child_guard import ROOT
from autograder.child_process import run_child
from autograder.sandbox import WALLED_ENVIRONMENT, Limits, grade_notebook

PROBE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)

def attempt(function):
    try:
        function()
        return "allowed"
    except OSError as error:
        return errno.errorcode.get(error.errno, str(error.errno))

def call(function, *args):
    if function(*args) != 0:
        raise OSError(ctypes.get_errno(), "refused")

def write(path):
    with open(path, "w") as handle:
        handle.write("x")

status = open("/proc/self/status").read()
report = {
    "uid": os.getuid(),
    "gid": os.getgid(),
    "capabilities": status.split("CapEff:")[1].split()[0],
    "seccomp": status.split("Seccomp:")[1].split()[0],
    "solutions": os.path.exists(sys.argv[2] + "/solutions"),
    "tests": os.path.exists(sys.argv[2] + "/tests"),
    "git": os.path.exists(sys.argv[2] + "/.git"),
    "answer": os.path.exists(sys.argv[3]),
    "scaffolding": os.path.exists(sys.argv[4]),
    "key": os.path.exists(sys.argv[5]),
    "environment": sorted(os.environ),
    "user namespace": attempt(lambda: call(libc.unshare, 0x10000000)),
    "mount namespace": attempt(lambda: call(libc.unshare, 0x00020000)),
    "mount": attempt(lambda: call(libc.mount, b"none", b"/usr", b"tmpfs", 0, None)),
    "ptrace": attempt(lambda: call(libc.ptrace, 16, 1, 0, 0)),
    "setuid": attempt(lambda: os.setuid(0)),
    "processes": len([p for p in os.listdir("/proc") if p.isdigit()]),
}
if sys.argv[6] == "walled":  # the control, the grader's own user, would really write these
    report["write venv"] = attempt(lambda: write(os.path.join(sys.prefix, "walls-probe.pth")))
    report["write course"] = attempt(lambda: write(sys.argv[2] + "/zero_core/walls_probe.py"))
    report["write tmp"] = attempt(lambda: write("/tmp/walls-probe"))
    report["write root"] = attempt(lambda: write("/walls-probe"))
    report["write home"] = attempt(lambda: write(os.path.join(os.environ["HOME"], "scratch")))
os.write(int(sys.argv[1]), (json.dumps(report) + "\n").encode())
"""

WALLS = walls.available()
needs_walls = pytest.mark.skipif(isinstance(WALLS, str), reason=str(WALLS))


def probe(walled: bool, tmp_path: Path) -> dict:
    """The probe's report, run as `grade_notebook` runs its child (walled or not)."""
    from autograder import ex04

    answer = ROOT / "zero_core" / "answers" / "ex04.py"
    scaffolding = ROOT / "zero_core" / "stages" / "zero3.py"
    key = tmp_path / ".grades.csv.key"
    key.write_bytes(b"secret")
    assert answer in walls.module_files(ex04.ANSWER_MODULES) and answer.exists()
    read, write = os.pipe()
    command = [sys.executable, "-I", "-c", PROBE, str(write), str(ROOT), str(answer), str(scaffolding), str(key),
               "walled" if walled else "control"]
    seccomp_fd = -1
    env = dict(os.environ)
    if walled:
        readable = walls.course_files(excluded=walls.module_files(ex04.ANSWER_MODULES))
        command, seccomp_fd = WALLS.wrap(command, readable, dict(WALLED_ENVIRONMENT))
        env = None
    run = run_child(command, env, 60, (read, write), (seccomp_fd,) if seccomp_fd >= 0 else ())
    assert run.returncode == 0, run.stderr_tail
    return json.loads(run.results)


@needs_walls
def test_the_walled_child_is_nobody_without_capabilities_under_seccomp(tmp_path: Path) -> None:
    report = probe(True, tmp_path)
    assert (report["uid"], report["gid"]) == (walls.NOBODY, walls.NOBODY)
    assert report["capabilities"] == "0000000000000000"
    assert report["seccomp"] == ("2" if seccomp.program() else "0")
    control = probe(False, tmp_path)
    assert control["uid"] == os.getuid()


@needs_walls
def test_answers_solutions_tests_and_keys_are_absent_and_the_scaffolding_is_there(tmp_path: Path) -> None:
    report = probe(True, tmp_path)
    assert not any(report[name] for name in ("solutions", "tests", "git", "answer", "key")), report
    assert report["scaffolding"]
    assert set(report["environment"]) - {"PWD"} == set(WALLED_ENVIRONMENT), "nothing of the grader's environment"
    control = probe(False, tmp_path)
    assert all(control[name] for name in ("solutions", "tests", "answer", "key")), control


@needs_walls
def test_the_walled_child_writes_only_its_tmpfs_and_never_the_venv(tmp_path: Path) -> None:
    report = probe(True, tmp_path)
    assert report["write venv"] == "EROFS" and report["write course"] in ("EROFS", "ENOENT")
    assert report["write tmp"] != "allowed" and report["write root"] != "allowed"
    assert report["write home"] == "allowed"
    # the control is not run: as the grader's user it would write into the venv and the course


@needs_walls
def test_no_namespace_mount_ptrace_or_privilege_change_from_inside(tmp_path: Path) -> None:
    report = probe(True, tmp_path)
    for name in ("user namespace", "mount namespace", "mount", "ptrace", "setuid"):
        assert report[name] == "EPERM", (name, report[name])
    assert report["processes"] <= 3, "a PID namespace of its own: bubblewrap's init, the probe"
    control = probe(False, tmp_path)
    assert control["processes"] > report["processes"]


@needs_walls
def test_the_walls_are_built_for_the_grader_who_runs_them() -> None:
    assert WALLS.layered == (os.geteuid() == 0)
    assert ("uid 65534" in WALLS.describe()) == WALLS.layered


NORMAL_USER = 1000
"""The uid a root test runner becomes to try the walls as an instructor without privileges would."""


def closed_to_others(root: Path, remade: list[Path]) -> Path | None:
    """The first folder on the way to `root` (or `root` itself) that other users may not enter, or None. Folders
    under `remade` do not count: the view below makes them anew, 0755, `root` included (a checkout that
    `mktemp -d` made 0700 in `/tmp`), and binds what `root` holds as it is."""
    for folder in [*reversed(root.parents), root]:
        if any(folder.is_relative_to(top) for top in remade):
            continue
        needed = 0o005 if folder == root else 0o001
        if folder.stat().st_mode & needed != needed:
            return folder
    return None


def test_a_checkout_closed_to_others_is_named_with_its_fix() -> None:
    base = Path(tempfile.mkdtemp())  # not under tmp_path: pytest keeps that 0700, closed to others itself
    try:
        base.chmod(0o755)
        course = base / "private" / "course"
        course.mkdir(parents=True)
        (base / "private").chmod(0o700)
        assert closed_to_others(course, []) == base / "private"
        assert closed_to_others(course, [base]) is None  # remade 0755 by the view
        course.chmod(0o700)
        assert closed_to_others(course, [base]) is None  # remade 0755 too, its contents bound as they are
        (base / "private").chmod(0o755)
        assert closed_to_others(course, []) == course
    finally:
        shutil.rmtree(base)


def as_a_normal_user(command: list[str]) -> list[str]:
    """`command` run as uid `NORMAL_USER`, with no capabilities, on this machine's files: a first bubblewrap
    (root) shows the disk as it is, with `/tmp` fresh and root's home (mode 0700, where this machine keeps
    Python) replaced by a folder holding only the runtime and the course. A course under either is shown in a
    folder made anew, 0755, holding the course's own files: an instructor who is a normal user owns the
    checkout they grade from, whatever its mode, and this user stands in for them on files root owns."""
    hidden = [Path("/root"), Path("/tmp")]
    closed = closed_to_others(ROOT, hidden)
    if closed is not None:
        pytest.fail(
            f"{closed} is mode {closed.stat().st_mode & 0o777:o}: a grader who is a normal user cannot reach the "
            f"course there. Run `chmod o+rx {closed}`, or clone the course into a folder others may enter."
        )
    view = [str(WALLS.bwrap), "--dev-bind", "/", "/", "--die-with-parent", "--perms", "0755", "--tmpfs", "/root",
            "--perms", "1777", "--tmpfs", "/tmp"]
    made: set[Path] = set()
    for path in sorted({*walls.runtime_paths(), ROOT}, key=lambda p: len(p.parts)):
        top = next((h for h in hidden if path.is_relative_to(h)), None)
        if top is None:
            continue
        for parent in reversed(path.parents):
            if parent.is_relative_to(top) and parent != top and parent not in made:
                view += ["--perms", "0755", "--dir", str(parent)]
                made.add(parent)
        if path != ROOT:
            view += ["--ro-bind", str(path), str(path)]
            continue
        view += ["--perms", "0755", "--dir", str(ROOT)]
        made.add(ROOT)
        for entry in sorted(ROOT.iterdir()):
            if entry.is_symlink():
                view += ["--symlink", os.readlink(entry), str(entry)]
            else:
                view += ["--ro-bind", str(entry), str(entry)]
    drop = ["setpriv", f"--reuid={NORMAL_USER}", f"--regid={NORMAL_USER}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]
    return [*view, "--chdir", str(ROOT), *drop, "env", "-i", "PATH=/usr/bin:/bin", "HOME=/tmp", *command]


@needs_walls
@pytest.mark.skipif(os.geteuid() != 0, reason="the tests above already run as a normal user")
def test_the_walls_hold_for_a_grader_who_is_a_normal_user() -> None:
    """The walls' tests above, again as an instructor who is not root: the walls are then one bubblewrap in
    user namespaces (uid 65534 inside, the instructor's own uid outside)."""
    chosen = "built_for or nobody or absent or tmpfs or namespace or full_marks or every_process_inside"
    command = [sys.executable, "-I", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", chosen, __file__]
    done = subprocess.run(as_a_normal_user(command), capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "7 passed" in done.stdout, done.stdout[-1000:]


@needs_walls
@pytest.mark.skipif(os.geteuid() != 0, reason="the tests already run as a normal user")
def test_a_grader_who_is_a_normal_user_grades_a_class_inside_the_walls() -> None:
    """`python -m autograder grade` as uid 1000: walls on, the CSV and feedback written where that user may."""
    solution = ROOT / "solutions" / "ex05_memory_planning" / "ex05_memory_planning.ipynb"
    script = (
        "mkdir -p /tmp/class/student00/ex05_memory_planning && "
        f"cp {solution} /tmp/class/student00/ex05_memory_planning/ && "
        f"{sys.executable} -m autograder grade /tmp/class --out /tmp/grades.csv --feedback /tmp/feedback "
        "--assignments ex05_memory_planning --no-progress && cat /tmp/grades.csv /tmp/feedback/student00.txt"
    )
    secret = "echo instructor > /tmp/secret && chmod 600 /tmp/secret"
    command = ["AUTOGRADER_SECRET_FILE=/tmp/secret", "sh", "-c", f"{secret} && {script}"]
    done = subprocess.run(as_a_normal_user(["env", *command]), capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("student00,")]
    assert len(rows) == 1 and rows[0].startswith("student00,10,10,10,"), done.stdout[-2000:]
    assert ",on," in rows[0] and "walls off" not in done.stdout, done.stdout[-2000:]


def test_the_seccomp_program_is_well_formed() -> None:
    """Every instruction is 8 bytes, and every jump lands inside the program."""
    program = seccomp.x86_64_program()
    assert len(program) % 8 == 0
    count = len(program) // 8
    for index in range(count):
        code, jt, jf, _ = struct.unpack_from("<HBBI", program, index * 8)
        if code & 0x07 == 0x05:  # BPF_JMP
            assert index + 1 + max(jt, jf) < count


@needs_walls
def test_a_correct_notebook_earns_full_marks_inside_the_walls() -> None:
    from autograder.checks import total

    solution = ROOT / "solutions" / "ex02_zero1_sharded_adam" / "ex02_zero1_sharded_adam.ipynb"
    results = grade_notebook(solution, limits=Limits(walls=True))
    assert total(results) == (10, 10), [r.message for r in results if not r.passed]


def test_the_parent_refuses_a_venv_or_course_folder_any_user_may_write(tmp_path: Path) -> None:
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert walls.writable_by_others([open_folder / "venv"]) == [open_folder]
    assert walls.writable_by_others([sticky]) == []


def test_without_bubblewrap_the_walls_say_why_and_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(walls, "bwrap_path", lambda: None)
    walls.available.cache_clear()
    try:
        with pytest.raises(walls.WallsUnavailable, match="bubblewrap is not installed.*--no-walls"):
            walls.require()
    finally:
        walls.available.cache_clear()


def test_the_child_process_group_is_killed_at_the_time_limit() -> None:
    read, write = os.pipe()
    run = run_child([sys.executable, "-c", "import time; time.sleep(60)"], None, 1, (read, write))
    assert run.timed_out and run.returncode is not None and run.returncode < 0


def test_what_the_parent_reads_of_a_child_is_capped() -> None:
    from autograder.child_process import MAX_RESULTS_BYTES, MAX_STDERR_BYTES

    flood = (
        "import os, sys; fd = int(sys.argv[1]); chunk = b'x' * 2**20\n"
        f"for _ in range({MAX_RESULTS_BYTES // 2**20 + 4}): os.write(fd, chunk); sys.stderr.write('y' * 2**20)\n"
    )
    read, write = os.pipe()
    run = run_child([sys.executable, "-c", flood, str(write)], None, 60, (read, write))
    assert run.returncode == 0
    assert len(run.results) == MAX_RESULTS_BYTES
    assert len(run.stderr_tail) <= MAX_STDERR_BYTES


def test_the_kernel_counts_the_childs_peak_memory() -> None:
    """`wait4`'s peak resident set: what the child held, measured where the child cannot write."""
    # Held for half a second: the parent samples the child's memory every RSS_SAMPLE_S, and a child that exits as
    # soon as its pages are touched can leave before any sample sees them on a loaded machine (seen in CI).
    hold = ("import time; block = bytearray(300 * 2**20); block[::4096] = b'x' * len(block[::4096]); "
            "time.sleep(0.5)")
    small_read, small_write = os.pipe()
    small = run_child([sys.executable, "-c", "pass"], None, 60, (small_read, small_write))
    read, write = os.pipe()
    large = run_child([sys.executable, "-c", hold], None, 60, (read, write))
    assert large.peak_rss_bytes - small.peak_rss_bytes > 280 * 2**20


HOLDING_GRANDCHILD = ("import time; block = bytearray(300 * 2**20); block[::4096] = b'x' * len(block[::4096]); "
                      "time.sleep(3)")
HOLDING_CHILD = ("import subprocess, sys, threading, time\n"
                 "started = []\n"
                 "def start():\n"
                 f"    started.append(subprocess.Popen([sys.executable, '-c', {HOLDING_GRANDCHILD!r}]))\n"
                 "    started[0].wait()  # the thread lives on: its child stays its own, not the main thread's\n"
                 "worker = threading.Thread(target=start); worker.start()\n"
                 "while not started: time.sleep(0.01)\n"
                 "time.sleep(0.5); print(started[0].pid, flush=True); worker.join()\n")
"""A child whose second thread starts a process that holds 300 MiB: a walk of the child alone, or of its main
thread's children alone, misses that memory."""


def test_the_kernel_count_includes_a_grandchild_started_from_a_thread() -> None:
    """The sampler walks the child's whole tree, thread by thread, and the tree it walks is the one psutil finds
    by reading every process's parent."""
    from autograder.child_process import _descendants_by_scan, descendants

    watcher = subprocess.Popen([sys.executable, "-c", HOLDING_CHILD], stdout=subprocess.PIPE, text=True)
    grandchild_pid = int(watcher.stdout.readline())
    assert set(descendants(watcher.pid)) == set(_descendants_by_scan(watcher.pid)) == {watcher.pid, grandchild_pid}
    watcher.wait(timeout=60)
    read, write = os.pipe()
    run = run_child([sys.executable, "-c", HOLDING_CHILD], None, 60, (read, write))
    assert run.returncode == 0
    assert run.peak_rss_bytes > 300 * 2**20


@needs_walls
def test_the_kernel_count_sees_every_process_inside_the_walls() -> None:
    """The same inside the walls, where the sampler reads processes of uid 65534 in namespaces of their own:
    as root here (the layered walls), as a normal user in `test_the_walls_hold_for_a_grader_who_is_a_normal_user`
    (user namespaces)."""
    line, seccomp_fd = WALLS.wrap([sys.executable, "-I", "-c", HOLDING_CHILD], [], {"PATH": "/usr/bin:/bin"})
    read, write = os.pipe()
    run = run_child(line, None, 60, (read, write), tuple(fd for fd in (seccomp_fd,) if fd >= 0))
    assert run.returncode == 0, run.stderr_tail
    assert run.peak_rss_bytes > 300 * 2**20


def attack(name: str):
    from tests.fixture_text import read_fixture
    from tests.test_grading_integrity import FIXTURES, WrongSubmission

    return WrongSubmission.read(FIXTURES / name), read_fixture(FIXTURES / name)[0]


@needs_walls
@pytest.mark.parametrize("walled", [True, False], ids=["walls", "control-without-walls"])
def test_a_submission_reading_the_solutions_through_torch_leaks_them_only_without_the_walls(
    walled: bool, tmp_path: Path
) -> None:
    wrong, meta = attack("ex05_reads_the_solutions_through_torch.py")
    results = grade_notebook(wrong.notebook(tmp_path), limits=Limits(walls=walled))
    feedback = "\n".join(r.message for r in results)
    assert sum(r.points for r in results) == 0
    if walled:
        assert meta["LEAKS"] not in feedback and "No such file" in feedback, feedback[:2000]
    else:
        assert meta["LEAKS"] in feedback, "the control: without the walls, the solution reaches the feedback"


@needs_walls
@pytest.mark.parametrize("walled", [True, False], ids=["walls", "control-without-walls"])
def test_a_submission_writing_into_the_venv_leaves_nothing_only_inside_the_walls(
    walled: bool, tmp_path: Path
) -> None:
    from autograder.checks import total

    wrong, meta = attack("ex05_writes_a_pth_file_into_the_venv.py")
    planted = Path(meta["WRITES"])
    planted.unlink(missing_ok=True)
    try:
        results = grade_notebook(wrong.notebook(tmp_path), limits=Limits(walls=walled))
        assert total(results) == (10, 10)
        if walled:
            assert not planted.exists()
        elif os.geteuid() == 0 or os.access(planted.parent, os.W_OK):
            assert planted.read_bytes().startswith(b"# written by a student"), "the control: the file appears"
    finally:
        planted.unlink(missing_ok=True)
