"""The rules of what a run owns (harness/outputs.py, docs/results-format.md), tested on sequences of
operations that Hypothesis draws (a stateful test) rather than one case at a time.

The operations, on FedAvg with the synthetic dataset (3 rounds): a run, with the arguments A or B
(another learning rate), with no flag, --resume, --overwrite or both, on --out a.json, its sibling
a.txt (the same stem) or b.json, stopped or not by SIGINT, SIGTERM or SIGKILL at a random moment;
two runs at once; deleting a checkpoint; a foreign thing (a user's file, a folder, undecodable
bytes) put at one of a run's paths, and taken away again. Every run is a forked process of this one
(torch already imported), so that a signal reaches it as it would a script.

After every step: (1) a complete result changes only through a completed --overwrite; (2) every
complete result equals the uninterrupted run with its arguments; (3) nothing but runs' own files is
made or changed, and a foreign thing is refused, in one line, and left as it was; (4) a run that
ended normally (exit 0, 2, 130, 143) leaves no temporary file and no lock.

CI runs a few dozen steps; FEDOOD_SLOW=1 runs many more (pytest -q harness/test_outputs.py).
"""

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import fedavg
import torch

BASE = [
    "--dataset",
    "synthetic",
    "--test-domain",
    "0",
    "--clients",
    "4",
    "--sample",
    "2",
    "--rounds",
    "3",
    "--eval-every",
    "1",
    "--checkpoint-minutes",
    "60",
]
ARGS = {"A": [], "B": ["--lr", "0.1"]}
LR = {0.05: "A", 0.1: "B"}  # a result's own record of which arguments made it
OUTS = ["a.json", "a.txt", "b.json"]
FLAGS = {
    "": [],
    "resume": ["--resume"],
    "overwrite": ["--overwrite"],
    "both": ["--overwrite", "--resume"],
}
OWN = ("", ".ckpt", ".lock", ".next.ckpt")
NORMAL = {0, 2, 130, 143}
SLOW = os.environ.get("FEDOOD_SLOW") == "1"


def launch(argv, logs, tag):
    """fedavg.main(argv) in a forked process, its output to logs/<tag>.out and .err (made here: a
    signal may end it before it opens them): its pid."""
    for ending in (".out", ".err"):
        (logs / f"{tag}{ending}").touch()
    pid = os.fork()
    if pid:
        return pid
    code = 99
    started = False                               # (fedavg.main entered)
    try:
        torch.set_num_threads(1)
        sys.stdout = open(logs / f"{tag}.out", "w", buffering=1)
        sys.stderr = open(logs / f"{tag}.err", "w", buffering=1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            started = True
            fedavg.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        # a SIGINT at once (after=0.0) can land before main: nothing was run, as a script's
        # `import harness` says (harness.starting, exit 130); inside main it is a defect
        code = 99 if started else 130
        if started:
            traceback.print_exc()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(pid, seconds=120):
    """The exit status: the code, or minus the signal that ended it."""
    end = time.time() + seconds
    while time.time() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"a run took more than {seconds} s")


def numbers(result):
    """What must equal the uninterrupted run's: the result less its timings and its provenance."""
    r = json.loads(json.dumps(result))
    for key in ("provenance", "label"):
        r.pop(key, None)
    for k in ("out", "resume", "overwrite", "allow_code_change"):
        r["args"].pop(k, None)
    for d in r["domains"].values():
        for row in d["history"]:
            row.pop("seconds")
    return r


REFERENCE = {}


def reference(which):
    """The uninterrupted run with arguments `which`, once per process."""
    if which not in REFERENCE:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ref.json"
            rc = wait(launch(BASE + ARGS[which] + ["--out", str(out)], Path(tmp), "ref"))
            assert rc == 0, (Path(tmp) / "ref.err").read_text()
            REFERENCE[which] = numbers(json.loads(out.read_text()))
    return REFERENCE[which]


def snapshot(folder):
    """{name: bytes, or 'folder'} of everything in the runs' folder."""
    return {p.name: "folder" if p.is_dir() else p.read_bytes() for p in folder.iterdir()}


def complete_results(folder):
    """{--out name: its bytes} of the complete results in the runs' folder."""
    done = {}
    for name in OUTS:
        try:
            raw = (folder / name).read_bytes()
            r = json.loads(raw)
        except (OSError, ValueError):
            continue
        if isinstance(r, dict) and r.get("complete") is True:
            done[name] = raw
    return done


# ------------------------------------------------------------------ each rule, one case at a time

from data import UserError  # noqa: E402
from harness import outputs  # noqa: E402

from harness import provenance, runner  # noqa: E402
from tests.helpers import stopped_at_checkpoint  # noqa: E402


def refusal(out, **flags):
    with pytest.raises(UserError) as e:
        with outputs.claim(out, **flags):
            pass
    return str(e.value)


@pytest.mark.parametrize("ending", ["", ".ckpt", ".lock", ".next.ckpt"])
@pytest.mark.parametrize("thing", ["notes", "bytes", "folder", "link"])
def test_only_its_own_files_whatever_the_flags(ending, thing, tmp_path):
    """A user's file, undecodable bytes, a folder or a link at any of a run's paths: refused in one
    line with every flag, and left as it was."""
    out = tmp_path / "r.json"
    path = Path(f"{out}{ending}")
    {
        "notes": lambda: path.write_text("my notes"),
        "bytes": lambda: path.write_bytes(b"\xff\xfe\x00"),
        "folder": path.mkdir,
        "link": lambda: path.symlink_to(tmp_path),
    }[thing]()
    for flags in ({}, {"resume": True}, {"overwrite": True}, {"resume": True, "overwrite": True}):
        line = refusal(out, **flags)
        assert (
            line.startswith(f"--out {out}: {path} is ")
            and "which no run replaces; nothing was touched" in line
            or ending == ""
            and thing in ("folder", "link")
            and line.startswith(f"--out {out} is a folder; give")
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert (
        path.is_symlink()
        if thing == "link"
        else path.is_dir()
        if thing == "folder"
        else path.read_bytes()
    )


def test_two_outs_never_share_a_file(tmp_path):
    """Every file is named from the whole --out: a.json and a.txt share none, and no --out ends like
    one."""
    a, b = outputs.Files(tmp_path / "a.json"), outputs.Files(tmp_path / "a.txt")
    assert not {p for p, _ in a.owned()} & {p for p, _ in b.owned()}
    for bad in ("r.ckpt", "r.json.lock", "r.next", "r.json.123.tmp"):
        assert "a results file may not end in .ckpt, .lock, .next, .tmp" in refusal(tmp_path / bad)


def test_one_run_per_out_its_lock_released_and_a_dead_ones_taken_over(tmp_path):
    out = tmp_path / "r.json"
    with outputs.claim(out) as plan:
        assert plan.files.lock.read_text() == f"{os.getpid()}@{os.uname().nodename}"
        assert "is in use by another run (pid" in refusal(out)
    assert not plan.files.lock.exists()
    plan.files.lock.write_text(f"{2**22 + 12345}@{os.uname().nodename}")  # no such process
    with outputs.claim(out):
        pass
    plan.files.lock.write_text("1@another-host")  # never judged dead
    assert "pid 1 on another-host" in refusal(out)


def test_resume_needs_its_checkpoint_and_overwrite_replaces_at_the_end(tmp_path):
    out = tmp_path / "r.json"
    assert refusal(out, resume=True).endswith(
        "so nothing to continue: run without --resume to start"
    )
    with outputs.claim(out) as plan:
        assert (plan.read, plan.write, plan.replacing) == (None, plan.files.ckpt, False)
        plan.files.ckpt.write_bytes(outputs.ZIP + b"old")
        outputs.finish(plan, {"method": "m", "args": {}, "domains": {}, "complete": True})
    old = out.read_bytes()
    assert "holds a complete result" in refusal(out)
    plan.files.ckpt.unlink()
    line = refusal(out, resume=True)
    assert (
        "holds a complete result: --overwrite runs again "
        "(that result stays until the new run completes)"
        in line
    )
    with outputs.claim(out, overwrite=True) as plan:
        assert plan.replacing and plan.write == plan.files.next
        plan.write.write_bytes(outputs.ZIP + b"new")
        assert out.read_bytes() == old  # until it completes
    assert (
        out.read_bytes() == old
        and "holds an interrupted --overwrite, which --overwrite --resume" in refusal(out)
    )
    with outputs.claim(out, overwrite=True, resume=True) as plan:
        assert plan.read == plan.write == plan.files.next
        outputs.finish(plan, {"method": "m", "args": {"new": 1}, "domains": {}, "complete": True})
    assert json.loads(out.read_text())["args"] == {"new": 1}
    assert plan.files.ckpt.read_bytes() == outputs.ZIP + b"new" and not plan.files.next.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "r.json",
        "r.json.ckpt",
    ]  # no lock, no .tmp


def stopped_run(out, monkeypatch, argv=BASE):
    """FedAvg cut right after its round-1 checkpoint (as a kill would), in this process."""
    stopped_at_checkpoint(fedavg.main, argv + ["--out", str(out)], monkeypatch)


def test_a_checkpoint_resumes_only_under_its_method_and_its_code(tmp_path, monkeypatch, capsys):
    """Resuming under other code is refused in one line naming the changed file; --allow-code-change
    continues it, the result equal to the uninterrupted run's and recorded as mixed. A checkpoint of
    another method, or of code from before checkpoints recorded theirs, is refused too."""
    import fediir

    out = tmp_path / "r.json"
    stopped_run(out, monkeypatch)
    capsys.readouterr()
    made = torch.load(f"{out}.ckpt", weights_only=True)["code"]
    assert made[-1]["files"] == provenance.code_files(fedavg.fedavg_round)
    own = provenance.code_files
    monkeypatch.setattr(runner, "code_files", lambda fn: {**own(fn), "fedavg.py": "0" * 12})
    with pytest.raises(SystemExit):
        fedavg.main(BASE + ["--out", str(out), "--resume"])
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        f"fedavg.py: error: --resume: {out}.ckpt was made with other code: fedavg.py changed "
        f"since (commit "
    ) and line.endswith(
        "--allow-code-change continues it anyway, the result then recorded as mixed code"
    )
    res = fedavg.main(BASE + ["--out", str(out), "--resume", "--allow-code-change"])
    straight = fedavg.main(
        BASE + ["--out", str(tmp_path / "straight.json")]
    )  # (this process's threads)
    assert numbers(res) == numbers(straight) and len(res["provenance"]["mixed_code"]) == 2
    with pytest.raises(SystemExit):
        fediir.main(BASE + ["--out", str(out), "--resume"])
    assert f"{out}.ckpt is fedavg's checkpoint, not fediir's" in capsys.readouterr().err
    blob = torch.load(f"{out}.ckpt", weights_only=True)
    del blob["code"]
    torch.save(blob, f"{out}.ckpt")
    Path(out).unlink()
    with pytest.raises(SystemExit):
        fedavg.main(BASE + ["--out", str(out), "--resume"])
    assert "it was made before checkpoints recorded their code" in capsys.readouterr().err


class Outputs(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="outputs-"))
        self.folder, self.logs = self.tmp / "runs", self.tmp / "logs"
        self.folder.mkdir()
        self.logs.mkdir()
        self.foreign = {}  # path name -> what was put there (bytes, or "folder")
        self.n = 0

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self, which, out, flags):
        self.n += 1
        argv = BASE + ARGS[which] + FLAGS[flags] + ["--out", str(self.folder / out)]
        return launch(argv, self.logs, str(self.n)), str(self.n)

    def ended(self, runs):
        """Check each ended run [(out, flags, tag, exit status)] against the rules it can break
        alone."""
        for out, flags, tag, rc in runs:
            err = (self.logs / f"{tag}.err").read_text()
            assert "Traceback" not in err, err
            assert rc in NORMAL | {-signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT}, (rc, err)
            if rc == 2:
                assert len(err.strip().splitlines()) == 1, err
            if any(name.startswith(out) and name[len(out) :] in OWN for name in self.foreign):
                assert rc in (2, -signal.SIGKILL, -signal.SIGTERM, 130), (out, rc, err)  # refused
            if rc in NORMAL:
                left = [
                    p.name
                    for p in self.folder.iterdir()
                    if p.name.startswith(out)
                    and (p.name.endswith(".tmp") or p.name == f"{out}.lock")
                ]
                assert not [p for p in left if p not in self.foreign], (out, rc, left)

    def changed_only_by_overwrite(self, before, runs):
        """(1): a complete result before the step is the same after it, unless a run on its --out
        with --overwrite ended with exit 0."""
        after = complete_results(self.folder)
        for name, raw in before.items():
            if after.get(name) != raw:
                assert name in after, f"{name}: a complete result became incomplete or went away"
                assert any(
                    out == name and "--overwrite" in FLAGS[flags] and rc == 0
                    for out, flags, _, rc in runs
                ), (name, runs)

    @rule(
        which=st.sampled_from("AB"),
        out=st.sampled_from(OUTS),
        flags=st.sampled_from(list(FLAGS)),
        stop=st.sampled_from([None, signal.SIGINT, signal.SIGTERM, signal.SIGKILL]),
        after=st.floats(0.0, 1.5),
    )
    def run(self, which, out, flags, stop, after):
        before = complete_results(self.folder)
        pid, tag = self.start(which, out, flags)
        if stop is not None:
            time.sleep(after)
            try:
                os.kill(pid, stop)
            except ProcessLookupError:
                pass
        runs = [(out, flags, tag, wait(pid))]
        self.ended(runs)
        self.changed_only_by_overwrite(before, runs)

    @rule(
        which=st.sampled_from("AB"),
        out=st.sampled_from(OUTS),
        other=st.sampled_from(OUTS),
        flags=st.sampled_from(["", "overwrite"]),
    )
    def two_at_once(self, which, out, other, flags):
        before = complete_results(self.folder)
        (p1, t1), (p2, t2) = self.start(which, out, flags), self.start("A", other, flags)
        runs = [(out, flags, t1, wait(p1)), (other, flags, t2, wait(p2))]
        self.ended(runs)
        self.changed_only_by_overwrite(before, runs)

    @rule(out=st.sampled_from(OUTS))
    def delete_checkpoint(self, out):
        if f"{out}.ckpt" not in self.foreign:
            (self.folder / f"{out}.ckpt").unlink(missing_ok=True)

    @rule(
        out=st.sampled_from(OUTS),
        ending=st.sampled_from(OWN),
        thing=st.sampled_from([b"my notes\n", b"\xff\xfe\x00", "folder"]),
    )
    def put_foreign(self, out, ending, thing):
        path = self.folder / f"{out}{ending}"
        if path.exists() or path.name in self.foreign:
            return
        if thing == "folder":
            path.mkdir()
        else:
            path.write_bytes(thing)
        self.foreign[path.name] = thing

    @rule()
    def take_foreign_away(self):
        for name in list(self.foreign):
            p = self.folder / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            del self.foreign[name]

    @invariant()
    def complete_results_are_the_uninterrupted_runs(self):
        for name, raw in complete_results(self.folder).items():
            r = json.loads(raw)
            assert numbers(r) == reference(LR[r["args"]["lr"]]), name

    @invariant()
    def only_own_files(self):
        now = snapshot(self.folder)
        for name, thing in self.foreign.items():
            assert now.get(name) == thing, f"{name}: a foreign thing was touched"
        for name in now:
            if name in self.foreign:
                continue
            out = next((o for o in OUTS if name.startswith(o)), None)
            rest = name[len(out) :] if out else None
            assert out and (rest in OWN or rest.endswith(".tmp")), f"{name}: not a run's own file"


Outputs.TestCase.settings = settings(
    max_examples=40 if SLOW else 3,
    stateful_step_count=25 if SLOW else 9,
    deadline=None,
    derandomize=not SLOW,
    print_blob=True,
    database=None,
)  # (no .hypothesis/ folder in the checkout)
test_outputs_rules = Outputs.TestCase
