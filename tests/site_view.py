"""A fresh virtual environment that sees this one's installed packages except some
distributions: what `pip install chunk-llama` (without an extra, or with one) leaves a user
with, without downloading anything again.

The view is a folder of symbolic links to this environment's site-packages entries (each
package, module and .dist-info), leaving out every file of the excluded distributions; a
.pth line in the new environment puts it on sys.path. `.pth` files inside the view are not
processed (it is not a site directory), so editable installs of this environment stay out.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import sysconfig
from pathlib import Path


def distribution_entries(name: str) -> set[str]:
    """The top-level site-packages entries distribution `name` installed (its .dist-info included)."""
    files = importlib.metadata.distribution(name).files or []
    return {Path(str(f)).parts[0] for f in files if not str(f).startswith("..")}


def make_venv(root: Path, exclude: list[str], add: dict[str, Path] | None = None) -> Path:
    """A venv at `root` seeing this environment's packages but `exclude`'s (distribution
    names), plus `add` (entry name: path linked in the view); returns its python. Its
    site-packages are empty: the view is appended."""
    site = Path(sysconfig.get_path("purelib"))
    hidden = set().union(*(distribution_entries(name) for name in exclude))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    # inside the venv: dill (datasets' hashing) pickles modules outside sys.prefix by value
    view = root / "venv" / "site-view"
    view.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden and not entry.name.endswith(".pth") and entry.name != "__pycache__":
            (view / entry.name).symlink_to(entry)
    for name, path in (add or {}).items():
        (view / name).symlink_to(path)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(purelib) / "zz_site_view.pth").write_text(f"{view}\n")
    return python
