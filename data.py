"""Datasets as per-domain tensors, their splits into clients, and their input preparation.

`load(name, root, seed, ...)` returns a `Dataset`: a list of `Domain`s, each holding its images as a
uint8 tensor [N, C, H, W] and its labels as int64 [N], on the CPU. `federate` / `federate_fixed`
turn its domains into clients by the two protocols of docs/protocol.md, "lodo" (leave one domain
out) and "clients" (fixed clients with their own test sets), and `enough_clients` /
`stained_clients` say how many clients the data allows. Nothing here knows about models, methods
or a command line; nothing here downloads (the datasets' sources and layouts: docs/datasets.md;
the downloads: python -m harness.datasets). The MNIST family reads the 5,000 digits embedded in
assets/mnist5k.npz unless --data-root is given, never one silently for the other.
"""
import hashlib
import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# torchvision >= 0.29 warns on every image-codec call that TorchCodec supersedes it
warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)

EMBEDDED = Path(__file__).resolve().parent / "assets" / "mnist5k.npz"
SIZE = 224      # the photos' side in pixels: DomainBed's and the FedIIR code's evaluation transform


class UserError(Exception):
    """A problem with the user's input or environment: printed as one line, never a traceback."""


def why(e, limit=120):
    """An exception as one short line (torchvision's download errors span several): its type, and
    its text cut at a word boundary with an ellipsis; an exception without text (a failed assert
    inside torchvision's readers) says so."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " …"
    return f"{type(e).__name__}: {text}" if text else f"{type(e).__name__}, no message"


# What torchvision reads from --data-root (python -m harness.datasets --download NAME puts it
# there): its class and arguments.
TORCHVISION = {"mnist": ("MNIST", {}), "fmnist": ("FashionMNIST", {}),
               "emnist": ("EMNIST", {"split": "mnist"}), "cifar10": ("CIFAR10", {}),
               "cifar100": ("CIFAR100", {})}


def torchvision_set(name, root, test=True):
    """torchvision's dataset `name` as it is under root, its training and (test) test set: read,
    never fetched (a run never reaches the network for its data). Missing or unreadable: one line
    that says what was looked for and the command that fetches it."""
    kind, kw = TORCHVISION[name]
    get = f"python -m harness.datasets --download {name} --data-root {root or 'DIR'}"
    if root is None:
        raise UserError(f"{name} is not embedded: pass --data-root DIR ({get})")
    import torchvision.datasets as tvd
    raw = Path(root) / kind / "raw"
    splits = (True, False) if test else (True,)
    try:
        return [getattr(tvd, kind)(root, train=t, **kw) for t in splits]
    except Exception as e:
        # torchvision raises RuntimeError where the files are missing, AssertionError on a bad one
        had = sorted(p.name for p in raw.iterdir()) if raw.is_dir() else []
        if had:
            raise UserError(
                f"{kind} under {root} could not be read ({why(e, 80)}); {raw} holds "
                f"{', '.join(had[:4])}{' …' * (len(had) > 4)}: "
                f"delete what is not {kind}'s and get it with: {get}"
            ) from None
        raise UserError(f"no {kind} under {root}; get it with: {get}") from None


@dataclass
class Domain:
    name: str
    x: torch.Tensor                      # uint8 [N, C, H, W]
    y: torch.Tensor                      # int64 [N]
    x_test: torch.Tensor | None = None   # "clients" protocol only: this client's own test set
    y_test: torch.Tensor | None = None
    paths: list | None = None            # the photo datasets: the image file of each row


@dataclass
class Dataset:
    name: str
    domains: list
    num_classes: int
    protocol: str        # "lodo" or "clients"
    source: str          # one line saying where the data came from
    classes: tuple | None = None   # the photo datasets: label k is the class named classes[k]


# ----------------------------------------------------------------------------------------- MNIST

def mnist_arrays(root=None, kind="MNIST", test=True):
    """All digits of MNIST (train + test pooled; `test=False`: the training set only) as uint8
    [N, 28, 28] and int64 [N], plus a line naming the source. root=None: the embedded 5,000-digit
    subset (sorted by label: shuffle it)."""
    if root is None and kind == "MNIST":
        with np.load(EMBEDDED) as f:
            x, y = torch.from_numpy(f["images"]), torch.from_numpy(f["labels"]).long()
        return x, y, f"embedded MNIST subset ({len(y):,} real digits, assets/mnist5k.npz)"
    parts = torchvision_set(dict(MNIST="mnist", FashionMNIST="fmnist")[kind], root, test)
    x = torch.cat([p.data for p in parts])
    y = torch.cat([torch.as_tensor(p.targets) for p in parts]).long()
    return x, y, (f"torchvision {kind} under {root} ({len(y):,} images, "
                  f"{'train+test pooled' if test else 'train set'})")


ANGLES = range(0, 90, 15)     # RotatedMNIST's six domains, in degrees


def rmnist(root=None, seed=0):
    """RotatedMNIST as DomainBed / FedIIR: pooled digits, seeded shuffle, domain i = images[i::6],
    rotated by 0, 15, ..., 75 degrees (bilinear, fill 0)."""
    x, y, source = mnist_arrays(root)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm].unsqueeze(1), y[perm]
    domains = [Domain(str(a), rotate(x[i::6], a), y[i::6]) for i, a in enumerate(ANGLES)]
    return Dataset("rmnist", domains, 10, "lodo", source)


def rotate(x, degrees):
    """Rotate a uint8 batch [N, C, H, W] counter-clockwise (bilinear, fill 0), staying uint8."""
    import torchvision.transforms.functional as TF      # (here: what rotates nothing starts sooner)
    return TF.rotate(x, float(degrees), interpolation=TF.InterpolationMode.BILINEAR, fill=0)


# ------------------------------------------------------------- RC-MNIST (PerInvFL, Table 6)

P_TRAIN = (0.95, 0.90, 0.85, 0.80)   # colour-label agreement of clients 1..4 (PerInvFL Table 6)


def colored(x, digit, p, g):
    """IRM's ColoredMNIST law (Arjovsky et al.): 14x14 (every second pixel), label = (digit < 5)
    flipped with probability 0.25, colour = label kept with probability p (PerInvFL's p^e: the
    share of images whose colour agrees with the label), two channels with the other one zeroed."""
    y = (digit < 5).long() ^ (torch.rand(len(digit), generator=g) < 0.25).long()
    colour = y ^ (torch.rand(len(digit), generator=g) >= p).long()
    img = x[:, ::2, ::2]
    out = torch.zeros(len(y), 2, 14, 14, dtype=torch.uint8)
    out[torch.arange(len(y)), colour] = img
    return out, y


def rcmnist(root=None, seed=0, p_test=0.1, kind="MNIST", rotation=True):
    """RC-MNIST / RC-FMNIST as PerInvFL's Table 6 and Appendix (docs/datasets.md): 4 fixed clients,
    client i's training context of colour agreement P_TRAIN[i] and its test context of p_test, its
    images rotated by 90·i degrees (rotation=False: upright); training images from the first 5/6
    of the (seeded, shuffled) training set, test images from the rest."""
    x, digit, source = mnist_arrays(root, kind, test=False)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(digit), generator=g)
    x, digit = x[perm], digit[perm]
    n_tr, n_te = len(digit) * 5 // 6 // 4, len(digit) // 6 // 4
    domains = []
    for i, p in enumerate(P_TRAIN):
        tr = slice(i * n_tr, (i + 1) * n_tr)
        te = slice(4 * n_tr + i * n_te, 4 * n_tr + (i + 1) * n_te)
        xtr, ytr = colored(x[tr], digit[tr], p, g)
        xte, yte = colored(x[te], digit[te], p_test, g)
        k = i if rotation else 0
        rot = lambda z: torch.rot90(z, k, dims=(2, 3))
        domains.append(Domain(f"p{p:.2f}-rot{90 * k}", rot(xtr), ytr, rot(xte), yte))
    name = "rcmnist" if kind == "MNIST" else "rcfmnist"
    return Dataset(name, domains, 2, "clients", f"{source}; {name}: 4 clients x {n_tr:,} train / "
                   f"{n_te:,} test, p_train {', '.join(map(str, P_TRAIN))}, p_test {p_test}"
                   + ("" if rotation else ", no rotation"))


# ---------------------------------------------------------- WaterBird (PerInvFL Table 4 / 6)

WATER = ("Albatross", "Auklet", "Cormorant", "Frigatebird", "Fulmar", "Gull", "Jaeger",
         "Kittiwake", "Pelican", "Puffin", "Tern", "Gadwall", "Grebe", "Mallard", "Merganser",
         "Guillemot", "Pacific_Loon")  # Sagawa et al.
PLACES = {1: ("o/ocean", "l/lake/natural"),               # water
          0: ("b/bamboo_forest", "f/forest/broadleaf")}   # land
# PerInvFL Table 6, CUB train set
BIRD_RANGES = ((0, 1715), (1716, 2908), (2909, 3844), (3845, 5993))


def waterbird(root, seed=0, p_test=0.1, size=SIZE, n_train=400, n_test=100):
    """WaterBird as PerInvFL's Table 6 on Sagawa et al.'s law (docs/datasets.md: the layout under
    ROOT): 4 fixed clients; client i draws n_train + n_test birds from its index range of CUB's
    training images (BIRD_RANGES), each cut out with its mask and pasted on a Places photo that
    matches its label (WATER) with probability P_TRAIN[i] (training) or p_test (test)."""
    if root is None:
        raise UserError("waterbird needs --data-root DIR holding CUB_200_2011/, segmentations/ "
                        "and places/")
    cub, seg, places = (Path(root) / "CUB_200_2011", Path(root) / "segmentations",
                        Path(root) / "places")
    for d in (cub / "images", seg, places):
        if not d.is_dir():
            raise UserError(f"{d} not found (waterbird: CUB_200_2011/, segmentations/, "
                            "places/ under --data-root)")
    try:
        paths = dict(line.split() for line in (cub / "images.txt").read_text().splitlines()
                     if line.strip())
        split = dict(line.split()
                     for line in (cub / "train_test_split.txt").read_text().splitlines()
                     if line.strip())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {cub}/images.txt and train_test_split.txt ({why(e)})")
    train = [paths[i] for i in sorted(paths, key=int) if split.get(i) == "1"]
    g = torch.Generator().manual_seed(seed)
    pool = {k: [f for c in cats for f in sorted((places / c).glob("*.jpg"))]
            for k, cats in PLACES.items()}
    for k in pool:
        pool[k] = [pool[k][j] for j in torch.randperm(len(pool[k]), generator=g)]

    def compose(rel, label, p):
        water = label if torch.rand((), generator=g) < p else 1 - label
        if not pool[water]:
            raise UserError(f"not enough {'water' if water else 'land'} photos under {places}")
        m = decode(seg / Path(rel).with_suffix(".png"), size).float().mean(0, keepdim=True) / 255
        img = (decode(cub / "images" / rel, size).float() * m
               + decode(pool[water].pop(), size).float() * (1 - m))
        return img.round().to(torch.uint8)

    domains = []
    for i, (lo, hi) in enumerate(BIRD_RANGES):
        # scaled to the images found (the same on all 5,994)
        lo, hi = lo * len(train) // 5994, (hi + 1) * len(train) // 5994 - 1
        idx = list(range(lo, hi + 1))
        if len(idx) < 2:
            raise UserError(f"CUB_200_2011 has only {len(train)} training images: "
                            "too few for 4 clients")
        pick = [idx[j] for j in torch.randperm(len(idx), generator=g)[:n_train + n_test]]
        cut = max(1, round(len(pick) * n_train / (n_train + n_test)))
        y = torch.tensor([int(any(w in train[j].split("/")[0] for w in WATER)) for j in pick])
        parts = [torch.stack([compose(train[j], int(y[k]), pe)
                              for k, j in enumerate(pick) if sl.start <= k < sl.stop])
                 for sl, pe in ((slice(0, cut), P_TRAIN[i]), (slice(cut, len(pick)), p_test))]
        domains.append(Domain(f"p{P_TRAIN[i]:.2f}-birds{lo}-{hi}",
                              parts[0], y[:cut], parts[1], y[cut:]))
    return Dataset("waterbird", domains, 2, "clients",
                   f"waterbird from {root} (CUB train birds, Places backgrounds; "
                   f"{', '.join(str(len(d.y)) for d in domains)} train per client, "
                   f"p_test {p_test})")


# ------------------------------------------------------------------- Dirichlet label skew (FL)

def dirichlet_split(y, n_clients, alpha, seed, min_size=None):
    """Label-skew partition (NIID-Bench / PFLlib style): for every class, draw client proportions
    from Dirichlet(alpha), give no more to clients that already hold >= N / n_clients, and cut the
    class's shuffled indices accordingly. Redraw until every client holds at least `min_size`
    examples: NIID-Bench's 10, lowered to N / (20 n_clients) for small data (the embedded 5,000
    digits over 100 clients at alpha 0.1 leave a few clients empty in most draws), but at least 3
    so that every client keeps a training, a validation and a test example.
    Returns a list of int64 index tensors, one per client."""
    y = np.asarray(y)
    n = len(y)
    if n_clients < 1:
        raise UserError(f"--clients must be positive, got {n_clients}")
    if min_size is None:
        min_size = max(3, min(10, n // (20 * n_clients)))
    # no draw can succeed: refuse before drawing (1,000 draws take minutes)
    if n_clients * min_size > n:
        raise UserError(f"--clients {n_clients}: {n:,} examples cannot give every client "
                        f"{min_size} (a training, a validation and a test example at least); "
                        f"use at most {n // min_size:,} clients")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts = [[] for _ in range(n_clients)]
        for c in np.unique(y):
            ids = rng.permutation(np.flatnonzero(y == c))
            p = rng.dirichlet(np.full(n_clients, alpha))
            p = p * np.array([len(q) < n / n_clients for q in parts])
            # a tiny alpha puts all the mass on clients already full: a failed draw
            if not p.sum() > 0:
                break
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(ids)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(ids, cuts)):
                parts[k].extend(chunk.tolist())
        else:
            if min(len(q) for q in parts) >= min_size:
                return [torch.tensor(sorted(q), dtype=torch.long) for q in parts]
    raise UserError(f"no Dirichlet({alpha}) split of {n} examples over {n_clients} clients gives "
                    f"every client {min_size} examples: use fewer clients or a larger --alpha")


def label_skew(name, root=None, seed=0, clients=100, alpha=0.1, train_frac=0.75):
    """FedOMG's conventional FL setting: one dataset split over `clients` by Dirichlet(alpha);
    each client keeps the first 75% of its (shuffled) examples for training, the rest as its own
    test set."""
    if name == "mnist":
        x, y, source = mnist_arrays(root)
        x = x.unsqueeze(1)
    elif name == "emnist":
        x, y, source = emnist_arrays(root)
    else:
        x, y, source = cifar_arrays(root, name)
    num_classes = int(y.max()) + 1
    domains = []
    g = torch.Generator().manual_seed(seed)
    for k, idx in enumerate(dirichlet_split(y.numpy(), clients, alpha, seed)):
        idx = idx[torch.randperm(len(idx), generator=g)]
        cut = min(len(idx) - 1, max(1, int(train_frac * len(idx))))  # >= 1 train and 1 test
        tr, te = idx[:cut], idx[cut:]
        domains.append(Domain(f"client{k}", x[tr], y[tr], x[te], y[te]))
    return Dataset(name, domains, num_classes, "clients", f"{source}; Dirichlet(alpha={alpha}) "
                   f"label skew over {clients} clients")


def cifar_arrays(root, name):
    parts = torchvision_set(name, root)
    x = torch.cat([torch.from_numpy(p.data).permute(0, 3, 1, 2) for p in parts])
    y = torch.cat([torch.as_tensor(p.targets) for p in parts]).long()
    return x, y, f"torchvision {name} under {root} ({len(y):,} images, train+test pooled)"


def emnist_arrays(root):
    """EMNIST's 'mnist' split: FedOMG's Appendix D.1 describes its EMNIST as 70,000
    samples of 10 classes, which is that split. torchvision stores the images transposed;
    they are transposed back."""
    parts = torchvision_set("emnist", root)
    x = torch.cat([p.data.transpose(1, 2) for p in parts]).unsqueeze(1)
    y = torch.cat([p.targets for p in parts]).long()
    return x, y, (f"torchvision EMNIST (mnist split) under {root} "
                  f"({len(y):,} images, train+test pooled)")


# ------------------------------------------------------------- DomainBed image folders (photos)

FOLDERS = {"pacs": "PACS", "vlcs": "VLCS", "officehome": "office_home"}
# Each dataset's class names, in the order of Python's sorted() (DomainBed's ImageFolder numbers
# classes so): on a complete copy the labels are DomainBed's; on one whose domains lack classes,
# still the same names' indices.
CLASSES = {"pacs": ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person"),
           "vlcs": ("bird", "car", "chair", "dog", "person"),
           "officehome": ("Alarm_Clock", "Backpack", "Batteries", "Bed", "Bike", "Bottle", "Bucket",
                          "Calculator", "Calendar", "Candles", "Chair", "Clipboards", "Computer",
                          "Couch", "Curtains", "Desk_Lamp", "Drill", "Eraser", "Exit_Sign", "Fan",
                          "File_Cabinet", "Flipflops", "Flowers", "Folder", "Fork", "Glasses",
                          "Hammer", "Helmet", "Kettle", "Keyboard", "Knives", "Lamp_Shade",
                          "Laptop", "Marker", "Monitor", "Mop", "Mouse", "Mug", "Notebook", "Oven",
                          "Pan", "Paper_Clip", "Pen", "Pencil", "Postit_Notes", "Printer",
                          "Push_Pin", "Radio", "Refrigerator", "Ruler", "Scissors", "Screwdriver",
                          "Shelf", "Sink", "Sneakers", "Soda", "Speaker", "Spoon", "TV", "Table",
                          "Telephone", "ToothBrush", "Toys", "Trash_Can", "Webcam")}
FAKE_MARK = "FAKE.txt"   # beside the domains of a tree that harness/datasets.py made up
IMAGE_EXT = {".jpg", ".jpeg", ".png", ".bmp"}


def image_folder(name, root, size=SIZE):
    """ROOT/<Dataset>/<domain>/<class>/<image>, domains sorted (DomainBed). A label is the index of
    its class folder's name among the dataset's classes (CLASSES), in every domain: a domain may
    lack classes (a note names them) without moving another class's label, and a folder named as
    none of the classes is refused. Images are resized to size x size (the evaluation transform of
    DomainBed / FedIIR) and cached as uint8."""
    domains = photo_domains(name, root)
    base = Path(root) / FOLDERS[name]
    found = {d: sorted(c.name for c in (base / d).iterdir()
                       if c.is_dir() and not c.name.startswith("."))
             for d in domains}
    classes = CLASSES[name]
    known_classes(name, base, found)
    files = [(d, k, f) for d in domains for k, c in enumerate(classes) if (base / d / c).is_dir()
             for f in sorted((base / d / c).iterdir()) if f.suffix.lower() in IMAGE_EXT]
    if not files:
        raise UserError(f"no images under {base}/<domain>/<class>/ "
                        f"(looked for {sorted(IMAGE_EXT)})")
    missing_classes(name, base, domains, {(d, k) for d, k, _ in files})
    x = decoded([f for _, _, f in files], base, size)
    y = torch.tensor([k for _, k, _ in files])
    dom = np.array([d for d, _, _ in files])
    out = [Domain(d, x[torch.from_numpy(dom == d)], y[torch.from_numpy(dom == d)],
                  paths=[f for e, _, f in files if e == d]) for d in domains]
    fake = ("; FAKE: random images from harness.datasets --make-fake, not the dataset"
            if (base / FAKE_MARK).exists() else "")
    return Dataset(name, out, len(classes), "lodo",
                   f"{base} ({len(files):,} images, cached at {size}px){fake}",
                   classes)


def decoded(files, base, size):
    """The image files (under `base`), each resized to size x size, as one uint8 tensor: decoded
    once, cached in base/.cache-<size>.pt, keyed by the files in order with their sizes and
    modification times (a file added, removed or changed rebuilds it). Never the labels."""
    listed = "\n".join(f"{f.relative_to(base)} {f.stat().st_size} {f.stat().st_mtime_ns}"
                       for f in files)
    key, cache = hashlib.sha256(listed.encode()).hexdigest(), base / f".cache-{size}.pt"
    if cache.exists():
        try:
            blob = torch.load(cache, weights_only=True)
            x, cached_key = blob["x"], blob["key"]
        except Exception as e:
            raise UserError(f"corrupt cache {cache} ({type(e).__name__}); delete it to rebuild it")
        if cached_key == key:
            return x
        print(f"note: the files under {base} changed since {cache.name} was written; rebuilding it")
    print(f"decoding {len(files):,} images under {base} once (cached in {cache.name})")
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        x = torch.stack(list(pool.map(lambda f: decode(f, size), files)))
    tmp = cache.with_suffix(".tmp")
    try:
        torch.save({"x": x, "key": key}, tmp)
        os.replace(tmp, cache)
    except OSError as e:  # e.g. a read-only copy of the dataset: go on, decode again next time
        print(f"note: cannot write the cache {cache} ({e.strerror or e}); decoding again next time")
    return x


def photo_domains(name, root):
    """The domains of a photo dataset: the folders under ROOT/<Dataset>, sorted (DomainBed); a
    missing one is refused in one line with the command that fetches it."""
    get = f"python -m harness.datasets --download {name} --data-root {root or 'DIR'}"
    if root is None:
        raise UserError(f"{name} needs --data-root DIR holding "
                        f"{FOLDERS[name]}/<domain>/<class>/<images>; get it with: {get}")
    base = Path(root) / FOLDERS[name]
    if not base.is_dir():
        raise UserError(f"{base} not found; get it with: {get} (or lay out any copy as "
                        f"{FOLDERS[name]}/<domain>/<class>/<images>)")
    return sorted(d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith("."))


def known_classes(name, base, found):
    """Every class folder must be named as one of the dataset's classes: a label is the index of its
    folder's name among them, so a stray folder (PACS/sketch/Dog beside dog) or a domain that names
    its classes its own way (hund for dog) has no label. Nothing maps such names (DomainBed's layout
    has the same class folders in every domain): the odd folders are named in one line, to rename or
    remove. found: {domain: class folders}."""
    classes = CLASSES[name]
    odd = {d: [c for c in cs if c not in classes] for d, cs in found.items()}
    odd = {d: cs for d, cs in odd.items() if cs}
    if odd:
        listed = (", ".join(classes) if len(classes) <= 10
                  else f"the {len(classes)} of data.CLASSES[{name!r}]")
        raise UserError(f"class folders named as none of {name}'s classes ({listed}): "
                        + "; ".join(f"{base / d}: {', '.join(cs)}" for d, cs in odd.items())
                        + "; rename each to the class it holds, or remove it")


def missing_classes(name, base, domains, have):
    """One note naming the classes of which a domain holds no image (their labels stay
    unused there; no other label moves); a domain without any image is refused. have:
    {(domain, label)} of the images."""
    classes = CLASSES[name]
    lack = {d: [c for k, c in enumerate(classes) if (d, k) not in have] for d in domains}
    empty = [d for d in domains if len(lack[d]) == len(classes)]
    if empty:
        raise UserError(f"{', '.join(str(base / d) for d in empty)}: "
                        f"no images in {name}'s class folders "
                        f"({', '.join(classes) if len(classes) <= 10 else 'data.CLASSES'}); "
                        "a domain needs some")
    nowhere = [c for c in classes if all(c in lack[d] for d in domains)]
    parts = [f"no domain has {', '.join(nowhere)}"] * bool(nowhere) + \
            [f"{d} has no {', '.join(c for c in lack[d] if c not in nowhere)}" for d in domains
             if any(c not in nowhere for c in lack[d])]
    if parts:
        print(f"note: {base}: {'; '.join(parts)} (labels are the indices of "
              f"{name}'s {len(classes)} class names in every domain, "
              "so no other class's label moves)")


def read_rgb(path):
    """An image file (JPEG, PNG, BMP) as uint8 RGB [3, H, W]; a grayscale one with its value in
    every channel, as PIL's .convert("RGB"), which DomainBed's loader applies, gives it."""
    from torchvision.io import ImageReadMode, decode_image
    try:            # (the bytes read by Python's open: audit hooks see it, tests/test_sites.py)
        raw = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
        return decode_image(raw, mode=ImageReadMode.RGB)
    except Exception as e:
        raise UserError(f"cannot decode image {path} ({type(e).__name__})")


def decode(path, size):
    """read_rgb, resized to size x size (bilinear, antialiased: within
    one level of PIL's resize)."""
    import torchvision.transforms.functional as TF
    return TF.resize(read_rgb(path), [size, size],
                     interpolation=TF.InterpolationMode.BILINEAR, antialias=True)


# ------------------------------------------------------------------------- synthetic stand-ins

def synthetic(seed=0, n_domains=3, n_per_domain=240, num_classes=4, size=16):
    """Learnable toy domains for tests: the label is a class-specific binary pattern shared by all
    domains; each domain adds its own colour cast and noise level (the 'style')."""
    g = torch.Generator().manual_seed(seed)
    patterns = (torch.rand(num_classes, 1, size, size, generator=g) > 0.5).float()
    domains = []
    for d in range(n_domains):
        cast = torch.rand(3, 1, 1, generator=g) * 0.5
        y = torch.randint(num_classes, (n_per_domain,), generator=g)
        noise = torch.rand(n_per_domain, 3, size, size, generator=g) * (0.2 + 0.2 * d)
        x = 0.5 * patterns[y] + cast + noise
        domains.append(Domain(f"style{d}", (x.clamp(0, 1) * 255).to(torch.uint8), y))
    return Dataset("synthetic", domains, num_classes, "lodo",
                   f"synthetic ({n_domains} domains, seed {seed})")


# Ten colours; colour i + 5 is the complement (255 - c) of colour i, the background of "both".
PALETTE = torch.tensor([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 128, 0], [128, 0, 255],
                        [0, 255, 255], [255, 0, 255], [255, 255, 0], [0, 128, 255], [128, 255, 0]])
# The ten colour-digit combinations: digit y of combination k has colour PALETTE[STAINS[k, y]].
# Drawn once, the same for every --seed (docs/datasets.md: how and why; tests/test_data.py draws
# them again): whichever combination is held out, each of its pairs was seen in training.
STAINS = torch.tensor([[0, 9, 7, 5, 3, 1, 4, 8, 6, 2], [3, 9, 4, 2, 7, 8, 6, 5, 0, 1],
                       [4, 8, 1, 5, 3, 0, 6, 9, 7, 2], [9, 6, 4, 7, 3, 8, 2, 5, 0, 1],
                       [3, 9, 1, 7, 0, 8, 4, 5, 6, 2], [4, 5, 7, 0, 8, 1, 3, 9, 6, 2],
                       [9, 6, 1, 7, 0, 3, 2, 8, 4, 5], [4, 5, 6, 2, 8, 0, 3, 9, 7, 1],
                       [0, 8, 6, 5, 7, 3, 2, 9, 4, 1], [9, 6, 7, 0, 3, 1, 2, 8, 4, 5]])


def stained(root=None, seed=0, stain="fg"):
    """Stained MNIST of FedIPG (Section VI-C): ten fixed colour-digit combinations, one domain each;
    combination k stains digit y with colour PALETTE[M[k, y]], M = STAINS (drawn once, never from
    `seed`, so that every colour-digit pair of a held-out combination occurs in a training one).
    Within a combination the colour decides the label; across the nine, each colour goes with
    several digits. stain: "fg" colours the strokes (black background, under 50% of the area),
    "bg" the background (white strokes, over 50%), "both" the strokes and the background in the
    complementary colour (100%). Choices the text leaves open: the combinations (above); the
    pooled digits are shuffled (by `seed`) and dealt into 10 equal domains (k::10, as rmnist deals
    6); the label is the digit, without label noise; the colour is a deterministic function of
    (digit, k); images are 14x14 (every second pixel, as IRM's ColoredMNIST, whose MLP the model
    is); the palette above. Clients (stained_clients) draw from the nine pooled."""
    if stain not in ("fg", "bg", "both"):
        raise UserError(f"--stain must be fg, bg or both, got {stain!r}")
    M = STAINS
    x, y, source = mnist_arrays(root)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm][:, None, ::2, ::2].float() / 255, y[perm]
    domains = []
    for k in range(10):
        v, lab = x[k::10], y[k::10]
        c = PALETTE[M[k, lab]].float().view(-1, 3, 1, 1)
        img = {"fg": v * c, "bg": v * 255 + (1 - v) * c, "both": v * c + (1 - v) * (255 - c)}[stain]
        domains.append(Domain(f"c{k}", img.round().to(torch.uint8), lab))
    return Dataset("stained", domains, 10, "lodo",
                   f"{source}; stained ({stain}), 10 colour-digit combinations "
                   f"(the fixed mappings STAINS)")



# ------------------------------------------------------------------------- input preparation

# ImageNet-normalised, augmented like the FedIIR code
PHOTOS = ("pacs", "vlcs", "officehome", "waterbird")

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


# RGB -> YIQ
YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
YIQ_PAIR = (torch.linalg.inv(YIQ), YIQ)


def augment(x, gen, yiq=YIQ_PAIR):
    """The FedIIR code's training augmentation, batched on the device: RandomResizedCrop(scale
    0.7-1, ratio 3/4-4/3) and horizontal flip as one affine warp, ColorJitter(0.3, 0.3, 0.3, 0.3),
    RandomGrayscale(0.1). x: float [N, 3, H, W] in [0, 1]. Differences from torchvision: the crop
    is taken from the cached 224px image (not the original), a crop that would leave the image is
    clipped to it, jitter runs in a fixed order, and hue is a rotation in YIQ space.
    yiq: (YIQ⁻¹, YIQ) on x's device; make_prep moves them there once, because a copy to the GPU or
    an inverse on it inside a step would be a host synchronisation."""
    n, dev = x.shape[0], x.device
    u = lambda *s: torch.rand(*s, generator=gen, device=dev)
    area = 0.7 + 0.3 * u(n)
    ratio = torch.exp(math.log(3 / 4) + math.log(16 / 9) * u(n))
    w, h = (area * ratio).sqrt().clamp(max=1), (area / ratio).sqrt().clamp(max=1)
    flip = torch.where(u(n) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3, device=dev)
    theta[:, 0, 0], theta[:, 1, 1] = w * flip, h
    theta[:, 0, 2], theta[:, 1, 2] = (1 - w) * (2 * u(n) - 1), (1 - h) * (2 * u(n) - 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    f = lambda: (0.7 + 0.6 * u(n, 1, 1, 1))
    gray = lambda z: (0.299 * z[:, 0:1] + 0.587 * z[:, 1:2] + 0.114 * z[:, 2:3])
    x = (x * f()).clamp(0, 1)                                                     # brightness
    m = gray(x).mean((2, 3), keepdim=True)
    x = ((x - m) * f() + m).clamp(0, 1)                                           # contrast
    g = gray(x)
    x = ((x - g) * f() + g).clamp(0, 1)                                           # saturation
    # hue in [-0.3, 0.3] turns
    a = 2 * math.pi * 0.3 * (2 * u(n) - 1)
    to_rgb, to_yiq = yiq
    rot = torch.zeros(n, 3, 3, device=dev)
    rot[:, 0, 0], rot[:, 1, 1], rot[:, 2, 2] = 1, a.cos(), a.cos()
    rot[:, 1, 2], rot[:, 2, 1] = -a.sin(), a.sin()
    x = torch.einsum("ij,njk,kl,nlhw->nihw", to_rgb, rot, to_yiq, x).clamp(0, 1)
    return torch.where(u(n, 1, 1, 1) < 0.1, gray(x).expand_as(x), x)             # grayscale


def make_prep(dataset, device):
    """uint8 batch -> model input. Digits: pixels / 255. Photos: augmentation when training, then
    ImageNet mean/std (channels-last on CUDA for the ResNets)."""
    mean, std, yiq = MEAN.to(device), STD.to(device), tuple(m.to(device) for m in YIQ_PAIR)

    def prep(x, train=False, gen=None):
        x = x.float().div_(255)
        if dataset in PHOTOS:
            if train:
                x = augment(x, gen, yiq)
            x = (x - mean) / std
            if x.is_cuda:
                x = x.contiguous(memory_format=torch.channels_last)
        return x
    return prep


LODO = ("rmnist", "pacs", "vlcs", "officehome", "synthetic", "stained")
FL = ("mnist", "cifar10", "cifar100", "emnist")
FIXED = ("rcmnist", "rcfmnist", "waterbird")     # fixed clients, each with its own test context
NAMES = LODO + FL + FIXED


def load(name, root=None, seed=0, clients=100, alpha=0.1, size=SIZE, p_test=0.1, stain="fg",
         rotation=True):
    """The dataset `name` as per-domain CPU tensors (see the module docstring)."""
    if name == "rmnist":
        return rmnist(root, seed)
    if name in FOLDERS:
        return image_folder(name, root, size)
    if name == "synthetic":
        return synthetic(seed)
    if name == "stained":
        return stained(root, seed, stain)
    if name in FL:
        return label_skew(name, root, seed, clients, alpha)
    if name == "waterbird":
        return waterbird(root, seed, p_test, size)
    if name in FIXED:
        return rcmnist(root, seed, p_test, "MNIST" if name == "rcmnist" else "FashionMNIST",
                       rotation)
    raise UserError(f"unknown dataset {name!r}; choose from {', '.join(NAMES)}")


# ------------------------------------------------------------ clients: the protocols' federation
# How a dataset becomes clients (docs/protocol.md): leave-one-domain-out by FedIIR's Algorithm 2
# (stained: pooled samples, stained_clients), or the fixed clients; each holds out a validation
# split.

@dataclass
class Client:
    id: int
    domain: str
    x: torch.Tensor          # training split (uint8 images, on the device)
    y: torch.Tensor
    val_x: torch.Tensor      # this client's validation hold-out
    val_y: torch.Tensor
    test_x: torch.Tensor | None = None   # a fixed client's own test set; an evaluation site's
    test_y: torch.Tensor | None = None

    @property
    def n(self):
        return len(self.y)


@dataclass
class Federation:
    """The training clients (ids 0..P-1) and the evaluation sites, which hold a test set and never
    train (the held-out domain; ids P, P+1, ...). Every site evaluates on its own data and the
    server sums (common.evaluate_global): a site's test examples belong to the test set
    test_names.index(site.domain)."""
    name: str                # results key: the held-out domain, or "clients"
    clients: list
    evals: list
    test_names: list

    @property
    def sites(self):
        return self.clients + self.evals                        # on_clients' ids: their indices

    def pooled(self, split):
        """Every site's `split` ("val" or "test") in one: x, y and the id of each example's site."""
        have = [(i, getattr(s, f"{split}_x"), getattr(s, f"{split}_y"))
                for i, s in enumerate(self.sites) if getattr(s, f"{split}_y") is not None]
        return (torch.cat([x for _, x, _ in have]), torch.cat([y for _, _, y in have]),
                torch.cat([torch.full_like(y, i) for i, _, y in have]))


def split_counts(sizes, P, least=0):
    """FedIIR's Algorithm 2: one client per domain, then each further client goes to the domain with
    the most examples per client so far (ties: the first such domain); it stops before a chunk of
    floor(n / k) examples would fall below `least`."""
    k = [1] * len(sizes)
    for _ in range(P - len(sizes)):
        m = max(range(len(sizes)), key=lambda i: sizes[i] / k[i])
        if sizes[m] // (k[m] + 1) < least:
            break
        k[m] += 1
    return k


VAL_FRAC = 0.1   # the share of each client's examples held out for validation (docs/protocol.md)


def val_count(n, frac=VAL_FRAC):
    """How many of n examples holdout() keeps for validation: `frac`, at least 1, never all."""
    return min(n - 1, max(1, int(frac * n)))


def holdout(x, y, frac, g):
    """Shuffle, then the first `frac` of the examples is validation (at least one, but never the
    last training example), the rest train."""
    perm = torch.randperm(len(y), generator=g)
    nv = val_count(len(y), frac)
    return x[perm[nv:]], y[perm[nv:]], x[perm[:nv]], y[perm[:nv]]


def least_examples(batch_size):
    """The fewest examples a client needs for one full minibatch of batch_size training examples
    after its validation hold-out (at least 2). n - val_count(n) never falls as n grows."""
    n = max(2, batch_size)
    while n - val_count(n) < batch_size:
        n += 1
    return n


# How many clients the data allows, checked before a run trains (docs/protocol.md): every client
# holds one full minibatch of training examples after its validation hold-out (Algorithm 2's
# equal chunks of a domain), unless the batch asks for full-batch steps.

def domain_names(name, root=None):
    """A leave-one-domain-out dataset's domains by name, without loading it (the photos: the folders
    under ROOT); None where the clients are fixed, each with its own test set."""
    names = {"rmnist": [str(a) for a in ANGLES], "synthetic": [f"style{d}" for d in range(3)],
             "stained": [f"c{k}" for k in range(len(PALETTE))]}
    return photo_domains(name, root) if name in FOLDERS else names.get(name)


def enough_clients(ds, todo, P, B):
    """Leave-one-domain-out: the most clients of >= `least` examples each, testing on each domain
    to be run; refused in one line where --clients or --batch-size asks for more. A B at least the
    largest training domain, which no client can fill, asks for full-batch steps (PerInvFL's line
    9 at once): then a client needs a training and a validation example only."""
    sizes = {test: [len(d.y) for i, d in enumerate(ds.domains) if i != test] for test in todo}
    least = {test: 2 if B >= max(n) else least_examples(B) for test, n in sizes.items()}
    top = {test: sum(split_counts(n, min(P, sum(n) // least[test] + 1), least[test]))
           if min(n) >= least[test] else 0 for test, n in sizes.items()}
    test = min(todo, key=top.get)                      # the held-out domain that allows fewest
    where = f"testing on {ds.domains[test].name}, the {len(sizes[test])} training domains of " \
        f"{ds.name}"
    if P > top[test] and least[test] == 2:
        raise UserError(f"--clients {P} leaves clients without a training and a validation "
                        f"example: {where} hold {sum(sizes[test]):,} examples, enough for at most "
                        f"{top[test]:,} clients (Algorithm 2 cuts each domain into equal chunks "
                        f"of at least 2)")
    if top[test] == 0:    # not even one client per training domain holds a minibatch
        fits = min(n - val_count(n) for ns in sizes.values() for n in ns)
        small = min(sizes[test])
        raise UserError(f"--batch-size {B} is more than a client can hold: {where} include one "
                        f"of {small:,} examples, {small - val_count(small):,} for training after "
                        f"its validation hold-out; use --batch-size {fits:,} at most (or at least "
                        f"{max(max(n) for n in sizes.values()):,}, above every training domain: "
                        f"full-batch steps)")
    if P > top[test]:
        raise UserError(f"--clients {P} leaves clients fewer training examples than one minibatch "
                        f"(--batch-size {B}): {where} hold {sum(sizes[test]):,} examples, enough "
                        f"for at most {top[test]:,} clients (Algorithm 2's equal chunks of a "
                        f"domain need {least[test]:,} examples each: {B:,} to train on, the rest "
                        f"for validation)")


STAINED = {"fg": (5, 600), "bg": (5, 2000), "both": (20, 2000)}   # Section VI-C: P, per client


def stained_clients(ds, stain, P, size, C, B):
    """Stained MNIST's clients (Section VI-C): P x size, defaults by stain (STAINED), drawn from the
    nine pooled training combinations; a default size shrinks to fit the pool (a note says so),
    every client is sampled unless C says otherwise (docs/protocol.md); a client must hold one
    full minibatch of B for training, unless B is at least the pool (full-batch steps). Returns
    the settled (P, size, C)."""
    P0, n0 = STAINED[stain]
    P = P0 if P is None else P
    C = P if C in (None, "all") else C
    pool = sum(len(d.y) for d in ds.domains) - max(len(d.y) for d in ds.domains)
    if P < 1:
        raise UserError(f"--clients must be positive, got {P}")
    if size is None:
        size = min(n0, pool // P)
        if size < n0:
            print(f"note: stained {stain}: {P} clients x {n0:,} examples exceed the {pool:,} of "
                  f"the nine training combinations; each client gets {pool:,} // {P} = {size:,}")
    elif P * size > pool:
        raise UserError(f"--client-size {size} x --clients {P} exceeds the {pool:,} examples of "
                        f"the nine training combinations (at most {pool // P:,} per client)")
    if size < 2:
        raise UserError(f"{P} clients leave {size} example(s) each: too few for a training and a "
                        f"validation split; use fewer --clients")
    least = least_examples(B)   # one full minibatch, unless none can fill one
    if size < least and B < pool:
        raise UserError(f"{P} clients x {size:,} examples leave a client "
                        f"{size - val_count(size):,} for training after its validation hold-out, "
                        f"fewer than one minibatch (--batch-size {B}): a client needs {least:,}, "
                        f"and the {pool:,} examples of the nine training combinations allow at "
                        f"most {pool // least:,} clients")
    if not 1 <= C <= P:
        raise UserError(f"--sample must be between 1 and --clients ({P}), got {C}")
    return P, size, C


def federate(ds, test, P, seed, device, val_frac=VAL_FRAC, client_size=None):
    """Leave-one-domain-out: domain `test` is the test set; every other domain is cut into
    Algorithm 2's clients (split_counts), each holding out `val_frac` for validation.
    client_size (stained): clients are disjoint seeded samples of the pooled training domains
    instead (docs/protocol.md)."""
    g = torch.Generator().manual_seed(seed)
    train = [d for i, d in enumerate(ds.domains) if i != test]
    t = ds.domains[test]
    clients = []
    if client_size is not None:
        origin = torch.cat([torch.full((len(d.y),), i) for i, d in enumerate(train)])
        if P * client_size > len(origin):
            raise UserError(f"{P} clients x {client_size} examples exceed the {len(origin):,} "
                            "of the training domains")
        X, Y = torch.cat([d.x for d in train]), torch.cat([d.y for d in train])
        perm = torch.randperm(len(origin), generator=g)
        for j in range(P):
            idx = perm[j * client_size:(j + 1) * client_size]
            name = "+".join(train[i].name for i in origin[idx].unique().tolist())
            clients.append(Client(len(clients), name,
                                  *(t.to(device) for t in holdout(X[idx], Y[idx], val_frac, g))))
    else:
        for d, k in zip(train, split_counts([len(d.y) for d in train], P)):
            perm = torch.randperm(len(d.y), generator=g)
            size = len(perm) // k
            for j in range(k):
                idx = perm[j * size:(j + 1) * size if j < k - 1 else len(perm)]
                split = holdout(d.x[idx], d.y[idx], val_frac, g)
                clients.append(Client(len(clients), d.name, *(t.to(device) for t in split)))
    none = t.x[:0].to(device), t.y[:0].to(device)
    held_out = Client(len(clients), t.name, *none, *none, t.x.to(device), t.y.to(device))
    return Federation(t.name, clients, [held_out], [t.name])


def federate_fixed(ds, seed, device, val_frac=VAL_FRAC):
    """Fixed clients: every Domain of `ds` is a client with its own test set."""
    g = torch.Generator().manual_seed(seed)
    clients = [Client(i, d.name,
                      *(t.to(device)
                        for t in (*holdout(d.x, d.y, val_frac, g), d.x_test, d.y_test)))
               for i, d in enumerate(ds.domains)]
    return Federation("clients", clients, [], [d.name for d in ds.domains])


if __name__ == "__main__":   # the downloads and fake trees are the harness's (harness/datasets.py)
    import sys
    print("data.py: error: a module, not a program: fetch a dataset with python -m "
          "harness.datasets --download NAME --data-root DIR (--help: the others)", file=sys.stderr)
    sys.exit(2)
