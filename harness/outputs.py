"""What a run owns, stated once (docs/results-format.md, "What a run owns") and enforced here, for
the method scripts, flower/run_local.py and benchmark/run.py alike; and the files themselves: the
results JSON and the checkpoint beside it (save_checkpoint, load_checkpoint: what a --resume may
continue), each written by the one atomic writer, write_atomically.

A run with --out F owns these files, each named from the whole path F, so that two --out paths
never share one:

    F            its results JSON (a dict with "method", "args", "domains" and "complete")
    F.ckpt       its checkpoint (torch's zip format): the model and the method's state
    F.lock       its lock while it runs ("pid@host")
    F.next.ckpt  an --overwrite run's checkpoint until that run completes (then it is F.ckpt)

An --out may not end in .ckpt, .lock, .next or .tmp (the endings of those names and of the
temporary files their atomic writes use), so no --out names another run's file.

- Only its own files: anything else at one of those paths (a user's file, a folder, a device, a
  link, a file of another format) is refused in one line whatever the flags, and never unlinked,
  truncated or written over.
- One run per F at a time (F.lock); a dead run's lock on this host is taken over.
- --overwrite replaces F and F.ckpt only when the new run completes. Until then they stay as they
  were and the new run checkpoints to F.next.ckpt, which --overwrite --resume continues.
- --resume needs a checkpoint, and never starts afresh over a result.
- With neither flag, a complete result or an interrupted run at F is refused.
"""

import contextlib
import json
import os
import platform
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from data import UserError

ENDINGS = (".ckpt", ".lock", ".next", ".tmp")
ZIP = b"PK\x03\x04"  # torch.save's format: a zip archive
RESULT_KEYS = {"method", "args", "domains", "complete"}
LOCK = re.compile(r"(\d+)@(\S*)")
MAX_RESULTS = 64 * 2**20  # a results JSON is kB; a larger file is not one


class Files:
    """The paths of the files a run with --out `out` owns."""

    def __init__(self, out):
        self.out = Path(out)
        self.ckpt, self.lock, self.next = (
            Path(f"{out}{e}") for e in (".ckpt", ".lock", ".next.ckpt")
        )

    def owned(self):
        return [
            (self.out, "results"),
            (self.ckpt, "ckpt"),
            (self.next, "ckpt"),
            (self.lock, "lock"),
        ]


@dataclass
class Plan:
    """What a claimed run does with its files: the checkpoint it continues (None: it starts), the
    one it writes, and whether it replaces an older result or run (--overwrite: only once it
    completes)."""

    files: Files
    read: Path = None
    write: Path = None
    replacing: bool = False


def check_out(out, flag="--out"):
    """Refuse, before any work, an --out that could not take a run's files: a reserved ending, a
    folder, a path under a file, a folder this user cannot write in."""
    out = Path(out)
    if out.name.endswith(ENDINGS):
        raise UserError(
            f"{flag} {out}: a results file may not end in {', '.join(ENDINGS)} "
            f"(a run's own files end so); give e.g. {out}.json"
        )
    writable_file(out, flag)


def writable_file(path, flag):
    """Refuse a path that a script could not write a file at: a folder (or other non-file), a path
    under a file, a folder this user cannot write in. Checked before any work; makes the missing
    folders."""
    path = Path(path)
    if path.is_dir():
        raise UserError(
            f"{flag} {path} is a folder; give a file name, e.g. {path / 'results.json'}"
        )
    if path.exists() and not path.is_file():
        raise UserError(f"{flag} {path} is not a regular file")
    writable_folder(path.parent, flag, path)


def writable_folder(folder, flag, shown=None):
    """Make `folder` if missing and check that a file can be made in it; UserError naming `flag` if
    not."""
    folder, shown = Path(folder), shown or folder
    above = next((q for q in [folder, *folder.parents] if q.exists()), Path("."))
    if not above.is_dir():
        raise UserError(f"{flag} {shown}: {above} is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {flag} {shown}: {e.strerror or e}") from None


def foreign(path, kind):
    """Why the thing at `path` is not a run's own file of this kind (results, ckpt, lock); None when
    there is nothing there, or a file of that kind."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if not stat.S_ISREG(st.st_mode):
        return "a device or other special file"
    if kind == "results":
        return None if read_result(path) is not None else "not a results file of this project"
    try:
        with open(path, "rb") as f:
            head = f.read(4 if kind == "ckpt" else 256)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if kind == "ckpt":
        return None if head == ZIP else "not a checkpoint of this project"
    return None if lock_owner(head) is not None else "not a lock of this project"


def read_result(path):
    """The results dict at `path`, or None where it is missing or not a results file of this
    project."""
    try:
        if os.path.getsize(path) > MAX_RESULTS:
            return None
        r = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return r if isinstance(r, dict) and RESULT_KEYS <= r.keys() else None


def complete(path):
    """Whether `path` holds a finished run's results."""
    r = read_result(path)
    return bool(r and r.get("complete") is True)


def lock_owner(content):
    """(pid, host) of a lock's bytes; ("", "") for an empty one (a run between making it and writing
    it); None for anything else."""
    text = content.decode("ascii", errors="replace").strip()
    if not text:
        return "", ""
    m = LOCK.fullmatch(text)
    return (m[1], m[2]) if m else None


def alive(pid):
    """Whether a process of that id runs on this machine."""
    try:
        return os.kill(pid, 0) is None
    except PermissionError:  # alive, another user's
        return True
    except (ProcessLookupError, OverflowError):
        return False


def refuse_foreign(files):
    for path, kind in files.owned():
        why = foreign(path, kind)
        if why:
            raise UserError(
                f"--out {files.out}: {path} is {why}, which no run replaces; nothing was "
                f"touched: move it away, or give another --out"
            )


def take_lock(files):
    """Make F.lock for this process: refused while another run holds it (one on another host sharing
    the disk is never judged dead); a dead run's lock on this host is taken over."""
    host, mine = platform.node(), f"{os.getpid()}@{platform.node()}"
    for _ in range(3):
        try:
            with open(files.lock, "x") as f:  # exclusive creation: one run makes it
                f.write(mine)
            return mine
        except FileExistsError:
            try:
                owner = lock_owner(files.lock.read_bytes())
            except FileNotFoundError:  # released meanwhile
                continue
            except OSError as e:
                raise UserError(
                    f"--out {files.out}: its lock {files.lock} is unreadable "
                    f"({e.strerror}); nothing was touched"
                ) from None
            if owner is None:
                refuse_foreign(files)  # changed into something else meanwhile
                continue
            pid, where = owner
            if not pid or where not in ("", host) or alive(int(pid)):  # starting, elsewhere, alive
                raise UserError(
                    f"--out {files.out} is in use by another run (pid {pid or '?'} on "
                    f"{where or host}): wait for it to end, or give another --out "
                    f"(that run gone? delete {files.lock})"
                )
            files.lock.unlink(missing_ok=True)  # a dead run's on this machine: taken over
    raise UserError(
        f"--out {files.out}: its lock {files.lock} keeps changing hands; give another --out"
    )


def release(files, mine):
    """Remove F.lock if it is still this process's."""
    try:
        if files.lock.read_bytes().decode("ascii", errors="replace").strip() == mine:
            files.lock.unlink()
    except OSError:
        pass


def decide(files, resume, overwrite):
    """The plan for these flags and what is at F (its own files only: refuse_foreign ran first)."""
    result, has_ckpt, has_next = read_result(files.out), files.ckpt.exists(), files.next.exists()
    done = bool(result and result.get("complete") is True)
    if resume and overwrite:
        if not has_next:
            raise UserError(
                f"--overwrite --resume continues an interrupted replacement, and there is none "
                f"at {files.next}: --overwrite alone starts one"
            )
        return Plan(files, read=files.next, write=files.next, replacing=True)
    if resume:
        if has_ckpt:
            return Plan(files, read=files.ckpt, write=files.ckpt)
        why = f"--resume: no checkpoint at {files.ckpt}, so nothing to continue"
        if has_next:
            raise UserError(
                f"{why}; {files.next} holds an interrupted --overwrite: continue it with "
                f"--overwrite --resume"
            )
        if result is not None:
            raise UserError(
                f"{why}; {files.out} holds {'a complete' if done else 'an unfinished'} result: "
                f"--overwrite runs again (that result stays until the new run completes)"
            )
        raise UserError(f"{why}: run without --resume to start")
    if overwrite:
        if result is None and not has_ckpt:  # nothing to replace: an ordinary run
            files.next.unlink(missing_ok=True)  # (an older replacement's, given up)
            return Plan(files, write=files.ckpt)
        return Plan(files, write=files.next, replacing=True)  # an older F.next.ckpt: started again
    pending = (
        f"; {files.next} holds an interrupted --overwrite, which --overwrite --resume continues"
        if has_next
        else ""
    )
    if done:
        raise UserError(
            f"{files.out} holds a complete result; give another --out, or --overwrite to "
            f"replace it (it stays until the new run completes){pending}"
        )
    if result is not None or has_ckpt:
        raise UserError(
            f"{files.out} holds an interrupted run ({files.ckpt}"
            f"{'' if has_ckpt else ': missing'}): "
            + ("continue it with --resume, or " if has_ckpt else "")
            + f"start again with --overwrite (it replaces that run once complete){pending}"
        )
    if has_next:
        raise UserError(
            f"{files.next} holds an interrupted --overwrite of {files.out}: continue it with "
            f"--overwrite --resume, or start it again with --overwrite"
        )
    return Plan(files, write=files.ckpt)


@contextlib.contextmanager
def claim(out, resume=False, overwrite=False):
    """--out for this run alone, by the rules above: yields the Plan; the lock is released however
    the run ends. UserError (one line) before any work for everything the rules refuse. The
    folders it made for --out are removed again if the run leaves nothing in them."""
    parent = Path(out).absolute().parent
    made = [q for q in [parent, *parent.parents] if not q.exists()]     # the deepest first
    try:
        check_out(out)
        files = Files(out)
        refuse_foreign(files)
        mine = take_lock(files)
        try:
            refuse_foreign(files)  # (anything made while the lock was taken)
            yield decide(files, resume, overwrite)
        finally:
            release(files, mine)
    finally:
        for folder in made:
            try:
                folder.rmdir()                                      # empty ones only
            except OSError:
                break


def write_atomically(path, write):
    """The one way a run writes a file: write(tmp) makes it at a temporary path of this process's
    own (beside `path`, ending in .tmp), then it is renamed to `path`; a reader sees the old file
    or the new one, never half of one, and a failed write leaves no temporary file behind."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path, obj):
    """`obj` as JSON at `path`, atomically (results, and the tools' tables)."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
    write_atomically(path, write)


def finish(plan, results):
    """A run completed: its results to F, then (--overwrite) its checkpoint to F.ckpt. The results
    go first: a kill between the two leaves the new result with the older checkpoint, never the
    older result with a checkpoint that says it is done."""
    write_json(plan.files.out, results)
    if plan.replacing:
        if plan.write.exists():
            os.replace(plan.write, plan.files.ckpt)
        else:
            plan.files.ckpt.unlink(missing_ok=True)  # the older run's: it goes with its result


# ------------------------------------------------------------------------------ checkpoints
# F.ckpt (or F.next.ckpt): the model, the method's state and the training so far of the domain
# under way, the finished domains' results, the arguments and the code (docs/results-format.md).

def save_checkpoint(path, blob):
    """A checkpoint's dict at `path`, atomically (torch's zip format)."""
    write_atomically(path, lambda tmp: torch.save(blob, tmp))


def load_checkpoint(path, args, method=None, code=None):
    """The checkpoint at `path`, refused in one line where it cannot continue this run:
    unreadable, made by another method, with other arguments, or (unless --allow-code-change)
    with other code. `code`: this run's code_files."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        saved = blob["args"]
    except Exception as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: truncated, or not a "
                        f"checkpoint): --overwrite starts the run again and replaces it once "
                        f"complete") from None
    if "gen" in blob:    # one minibatch stream shared by all clients: the code before 3c1e8ca
        raise UserError(f"--resume: {path} was made when the clients shared one random stream; "
                        f"this code gives each client its own, so that run cannot be continued: "
                        f"start it again with --overwrite")
    if method and blob.get("method", method) != method:
        raise UserError(f"--resume: {path} is {blob['method']}'s checkpoint, not {method}'s; "
                        f"give {blob['method']}.py the same arguments, or another --out")
    now = identity(args)
    diff = sorted(k for k in set(saved) | set(now)
                  if saved.get(k) != now.get(k) and k != "data_root")
    if diff:
        raise UserError(f"--resume: {path} was made with other arguments ("
                        + ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff)
                        + ")")
    if code is not None:
        made = blob.get("code", [{}])[-1]
        files = made.get("files", {})
        changed = sorted(k for k in set(files) | set(code) if files.get(k) != code.get(k))
        if changed and not args.allow_code_change:
            what = (f"{', '.join(changed)} changed since (commit {made.get('commit') or '?'}"
                    f"{', dirty' if made.get('dirty') else ''})") if made else \
                "it was made before checkpoints recorded their code"
            raise UserError(f"--resume: {path} was made with other code: {what}; "
                            f"--allow-code-change continues it anyway, the result then recorded "
                            f"as mixed code")
    return blob


def to_device(obj, device):
    """A method's state (tensors in dicts and lists) moved to `device`."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return type(obj)(to_device(v, device) for v in obj) if isinstance(obj, (list, tuple)) \
        else obj


def identity(args):
    """The arguments that decide the numbers of a run (not --resume, --overwrite,
    --allow-code-change, --out, --checkpoint-minutes)."""
    return {k: v for k, v in vars(args).items()
            if k not in ("resume", "overwrite", "allow_code_change", "out", "checkpoint_minutes")}
