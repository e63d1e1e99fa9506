"""Install this repo into a --target folder WITHOUT building it: copy each package listed in
pyproject.toml from the folder its [tool.setuptools.package-dir] maps it to, with its package
data. scripts/gpu_session.sh falls back to it when `pip install --no-build-isolation .` cannot
build on the offline device (e.g. its setuptools is older than pyproject's build requirement).

    python scripts/gpu_copy_install.py SITE
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path


def source_dir(pkg: str, dirs: dict[str, str]) -> Path:
    """moegraph.runtime.calibrate -> runtime/calibrate: the longest mapped prefix gives the folder."""
    mapped = [k for k in dirs if pkg == k or pkg.startswith(k + ".")]
    if not mapped:
        raise SystemExit(f"gpu_copy_install: package {pkg!r} has no [tool.setuptools.package-dir] entry")
    top = max(mapped, key=len)
    return Path(dirs[top], *pkg[len(top):].split(".")[1:])


def main(site: Path) -> None:
    cfg = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    for pkg in cfg["packages"]:
        src, dst = source_dir(pkg, dirs), site.joinpath(*pkg.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.glob("*.py"):
            shutil.copy2(f, dst / f.name)
    for pkg, patterns in cfg.get("package-data", {}).items():
        src, dst = source_dir(pkg, dirs), site.joinpath(*pkg.split("."))
        for pattern in patterns:
            for f in src.glob(pattern):
                (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dst / f.relative_to(src))
    print(f"gpu_copy_install: {len(cfg['packages'])} packages copied into {site}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/gpu_copy_install.py SITE")
    main(Path(sys.argv[1]))
