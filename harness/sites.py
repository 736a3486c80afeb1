"""A site's own data: what a federated node reads (its folder, nothing else) and what the server
knows of it (its sizes). docs/flower.md: Several devices; docs/datasets.md: A site's folder.

A node's folder holds either
  an institution's photos    <folder>/<class>/<image>, the dataset's class names (data.CLASSES):
                             the node splits them itself, VAL_FRAC for validation, from the run's
                             seed; an evaluation-only site's are all its test set;
  an export                  site.json and one site of a benchmark split, exactly as the method
                             files' federation cuts it (`export`): the tensor datasets as data.pt,
                             the photos as their image files, in the split's order.

`export` writes a run's split as one folder per site (python -m harness.datasets --export); `read`
is what a node loads; `federation` is the Federation as the sizes say (every site a stand-in that
holds no data, but a node's own), what the server computes with; `settle` is after_load for a
server that holds no data.
"""
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

import common
import data
from data import UserError

FORMAT = "fedood-site/1"
MANIFEST = "site.json"
# the flags that decide a split: an export is refused by a run that gives any of them otherwise
SPLIT = ("seed", "clients", "test_domain", "client_size", "alpha", "p_test", "no_rotation", "stain")


def roster_entry(client):
    """What a site's sizes are, as the server sends them to every node: [domain, training,
    validation, test examples (None: no test set)]."""
    test = None if client.test_y is None else len(client.test_y)
    return [client.domain, client.n, len(client.val_y), test]


def stand_in(site, domain, n, n_val, n_test):
    """Site `site` of these sizes, holding no data: images of no pixels, labels 0."""
    blank = lambda k: (torch.zeros(k, 0, dtype=torch.uint8), torch.zeros(k, dtype=torch.long))
    return data.Client(site, domain, *blank(n), *blank(n_val),
                       *(blank(n_test) if n_test is not None else (None, None)))


def federation(roster, P, own=None):
    """The Federation of the sites in `roster` (roster_entry's, in site order): the first P train,
    the others are evaluation sites; each a stand-in of its sizes but `own`, a node's own site.
    Its name and test sets as data.federate's: the held-out domain, or the fixed clients'."""
    sites = [own if own is not None and own.id == i else stand_in(i, *entry)
             for i, entry in enumerate(roster)]
    clients, evals = sites[:P], sites[P:]
    if not evals:
        return data.Federation("clients", clients, [], [c.domain for c in clients])
    names = list(dict.fromkeys(s.domain for s in evals))
    return data.Federation("+".join(names), clients, evals, names)


def dataset(args, shape, classes, source):
    """A Dataset that holds no images, for what needs only their shape: the model (build_model)."""
    x = torch.zeros(0, *shape, dtype=torch.uint8)
    protocol = "lodo" if args.dataset in data.LODO else "clients"
    return data.Dataset(args.dataset, [data.Domain("sites", x, torch.zeros(0, dtype=torch.long))],
                        classes, protocol, source)


def settle(args, roster):
    """after_load for the server of a federation whose nodes hold the data: --clients is the number
    of training sites (required), --sample by default one per training domain, and every training
    site holds one minibatch (but full-batch steps, as data.enough_clients)."""
    P = args.clients
    domains = {entry[0] for entry in roster[:P]}
    args.sample = min(P, len(domains)) if args.sample is None else \
        P if args.sample == "all" else args.sample
    if not 1 <= args.sample <= P:
        raise UserError(f"--sample must be between 1 and --clients ({P}), got {args.sample}")
    n = [entry[1] for entry in roster[:P]]
    short = [k for k, m in enumerate(n) if m < args.batch_size]
    if short and args.batch_size < max(n):
        k = short[0]
        raise UserError(f"site {k} holds {n[k]:,} training examples, fewer than one minibatch "
                        f"(--batch-size {args.batch_size}); use --batch-size {min(n):,} at most")


# ----------------------------------------------------------------------------------- the export

def export(args, out):
    """Writes the split of a run (args: resolved) into `out`: site-K for every site, the first
    P training, then the evaluation sites (the held-out domain). Refused where `out` exists
    and is not empty, or --test-domain names more than one held-out domain; written in a folder
    beside `out` and renamed into place, so that a failure leaves nothing. Returns the folders."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder")
    ds = common.load_data(args)
    todo = common.after_load(args, ds)
    if len(todo) != 1:
        raise UserError(f"--test-domain {args.test_domain}: an export holds one split; name one "
                        f"held-out domain of {', '.join(d.name for d in ds.domains)}")
    fed, pools = indexed_federation(ds, todo[0], args)
    if todo[0] is not None:                             # the held-out domain by its name
        args.test_domain = ds.domains[todo[0]].name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for s in fed.sites:
            write_site(tmp / f"site-{s.id}", s, ds, pools, args, role="train" if s.id < len(
                fed.clients) else "evaluate", domains=[d.name for d in ds.domains])
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / f"site-{s.id}" for s in fed.sites]


def indexed_federation(ds, test, args):
    """data.federate (federate_fixed) of `ds` with every image replaced by its row in a pool of all
    the domains' images (and one of their test sets): the same draws (they follow the sizes only),
    so each site's rows say which images are its own, in its order. Returns (that Federation,
    {"x": the pools of images, labels and paths, "test": the test sets' pools})."""
    def pool(part):
        x = [getattr(d, "x" if part == "x" else "x_test") for d in ds.domains]
        if any(v is None for v in x):
            return None
        y = [getattr(d, "y" if part == "x" else "y_test") for d in ds.domains]
        paths = [p for d in ds.domains for p in (d.paths or [None] * len(d.y))] \
            if part == "x" else None
        return torch.cat(x), torch.cat(y), paths
    pools = {"x": pool("x"), "test": pool("test")}
    rows, offset, domains = 0, {"x": 0, "test": 0}, []
    for d in ds.domains:
        ids = {}
        for part, n in (("x", len(d.y)), ("test", None if d.y_test is None else len(d.y_test))):
            if n is not None:
                ids[part] = torch.arange(offset[part], offset[part] + n)[:, None]
                offset[part] += n
        domains.append(data.Domain(d.name, ids["x"], d.y, ids.get("test"), d.y_test))
    rows = data.Dataset(ds.name, domains, ds.num_classes, ds.protocol, ds.source, ds.classes)
    fed = data.federate_fixed(rows, args.seed, torch.device("cpu")) if test is None else \
        data.federate(rows, test, args.clients, args.seed, torch.device("cpu"),
                      client_size=getattr(args, "client_size", None))
    return fed, pools


def write_site(folder, s, ds, pools, args, role, domains):
    """One site's folder: site.json, and data.pt or the image files (photos)."""
    folder.mkdir()
    parts = {"x": (s.x, s.y), "val": (s.val_x, s.val_y), "test": (s.test_x, s.test_y)}
    pool_of = lambda part: pools["test"] if part == "test" and ds.protocol == "clients" \
        else pools["x"]
    x_pool, y_pool, paths = pools["x"]
    manifest = {"format": FORMAT, "dataset": args.dataset, "site": s.id, "role": role,
                "domain": s.domain, "domains": domains,
                "split": {k: getattr(args, k, None) for k in SPLIT},
                "classes": ds.num_classes, "shape": list(x_pool.shape[1:]), "source": ds.source,
                "sizes": {"n": s.n, "n_val": len(s.val_y),
                          "n_test": None if s.test_y is None else len(s.test_y)}}
    if paths is not None and all(p is not None for p in paths) and ds.protocol == "lodo":
        listed = {}
        for part, (rows, _) in parts.items():
            if rows is None:
                continue
            names = []
            for r in rows[:, 0].tolist():
                src = Path(paths[r])
                dest = folder / src.parent.name / src.name
                if dest.exists():
                    raise UserError(f"two images of site {s.id} are both named {dest.name} in "
                                    f"class {src.parent.name}: an export copies them by name")
                dest.parent.mkdir(exist_ok=True)
                shutil.copyfile(src, dest)
                names.append(f"{src.parent.name}/{src.name}")
            listed[part] = names
        manifest["photos"] = listed
    else:
        tensors = {}
        for part, (rows, _) in parts.items():
            if rows is None:
                continue
            x, y, _ = pool_of(part)
            tensors[part + "_x"], tensors[part + "_y"] = x[rows[:, 0]], y[rows[:, 0]]
        torch.save(tensors, folder / "data.pt")
        manifest["data"] = {"file": "data.pt", "sha256": sha256(folder / "data.pt")}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------- the node

def read(folder, args, site, evaluate_only):
    """A node's own site, from its folder alone: (data.Client on the CPU, its report: what the
    node tells the server when it connects). Bad input: UserError naming the folder."""
    folder = Path(folder)
    where = f"node folder {folder}"
    try:
        names = {p.name for p in folder.iterdir()}
    except FileNotFoundError:
        raise UserError(f"{where}: not found (node config data)") from None
    except NotADirectoryError:
        raise UserError(f"{where}: not a folder") from None
    except PermissionError:
        raise UserError(f"{where}: cannot be read (permission denied)") from None
    try:
        if MANIFEST in names:
            client, shape, classes, source = read_export(folder, args, site, evaluate_only)
        else:
            client, shape, classes, source = read_photos(folder, args, site, evaluate_only)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    except OSError as e:
        raise UserError(f"{where}: cannot be read ({e.strerror or e})") from None
    report = {"site": site, "role": "evaluate" if evaluate_only else "train",
              "dataset": args.dataset, "roster": roster_entry(client), "shape": shape,
              "classes": classes, "source": source}
    return client, report


def read_export(folder, args, site, evaluate_only):
    try:
        m = json.loads((folder / MANIFEST).read_text())
        assert m.get("format") == FORMAT
    except (ValueError, AssertionError):
        raise UserError(f"{MANIFEST} is not one of this project's exports ({FORMAT})") from None
    if m["dataset"] != args.dataset:
        raise UserError(f"holds an export of {m['dataset']}; this run is of {args.dataset}")
    if m["site"] != site:
        raise UserError(f"holds site {m['site']} of an export; this node is partition {site}")
    if (m["role"] == "evaluate") != evaluate_only:
        raise UserError("holds an evaluation site (the held-out domain) and its node config lacks "
                        "evaluate-only=true" if m["role"] == "evaluate" else
                        "holds a training site and its node config says evaluate-only=true")
    for k in SPLIT:
        mine, theirs = getattr(args, k, None), m["split"].get(k)
        if k == "test_domain" and mine not in (None, "all") and theirs != "all":
            mine = m["domains"][common.held_out(args.dataset, m["domains"], mine)[0]]     # a name
        if mine is not None and mine != theirs and not (k == "test_domain" and mine == "all"):
            flag = "--" + k.replace("_", "-")
            raise UserError(f"another run's export: {flag} {theirs} there, {mine} here")
    sizes = m["sizes"]
    if "photos" in m:
        files = {part: [folder / f for f in names] for part, names in m["photos"].items()}
        every = [f for part in ("x", "val", "test") for f in files.get(part, [])]
        for f in every:
            if not f.is_file():
                raise UserError(f"{f.relative_to(folder)} is listed in {MANIFEST} and missing")
        x = data.decoded(every, folder, data.SIZE)
        y = torch.tensor([data.CLASSES[args.dataset].index(f.parent.name) for f in every])
        cuts = [len(files.get(part, [])) for part in ("x", "val", "test")]
        parts = dict(zip(("x", "val", "test"), zip(x.split(cuts), y.split(cuts))))
        parts = {k: v for k, v in parts.items() if k in files}
    else:
        path = folder / m["data"]["file"]
        if sha256(path) != m["data"]["sha256"]:
            raise UserError(f"{path.name} is not the file {MANIFEST} names (changed since the "
                            "export)")
        blob = torch.load(path, weights_only=True)
        parts = {k: (blob[k + "_x"], blob[k + "_y"]) for k in ("x", "val", "test")
                 if k + "_x" in blob}
    none = parts["x"][0][:0], parts["x"][1][:0]
    client = data.Client(site, m["domain"], *parts.get("x", none), *parts.get("val", none),
                         *parts.get("test", (None, None)))
    if roster_entry(client)[1:] != [sizes["n"], sizes["n_val"], sizes["n_test"]]:
        raise UserError(f"its data are not the sizes {MANIFEST} states")
    return client, m["shape"], m["classes"], m["source"]


def read_photos(folder, args, site, evaluate_only):
    if args.dataset not in data.FOLDERS:
        raise UserError(f"holds no {MANIFEST}: the {args.dataset} data reach a node as an export "
                        f"(python -m harness.datasets --export)")
    classes = data.CLASSES[args.dataset]
    found = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    odd = [c for c in found if c not in classes]
    if odd:
        listed = ", ".join(classes) if len(classes) <= 10 else f"the {len(classes)} of data.CLASSES"
        raise UserError(f"class folders named as none of {args.dataset}'s classes ({listed}): "
                        f"{', '.join(odd)}; rename each to the class it holds, or remove it")
    files = [(k, f) for k, c in enumerate(classes) if c in found
             for f in sorted((folder / c).iterdir()) if f.suffix.lower() in data.IMAGE_EXT]
    if not files:
        raise UserError(f"no images in <class>/ folders of {args.dataset}'s classes (looked for "
                        f"{', '.join(sorted(data.IMAGE_EXT))})")
    x = data.decoded([f for _, f in files], folder, data.SIZE)
    y = torch.tensor([k for k, _ in files])
    none = x[:0], y[:0]
    if evaluate_only:
        client = data.Client(site, folder.name, *none, *none, x, y)
    else:
        g = torch.Generator().manual_seed(args.seed)
        client = data.Client(site, folder.name, *data.holdout(x, y, data.VAL_FRAC, g))
    return client, list(x.shape[1:]), len(classes), f"{len(files):,} images of its own"
