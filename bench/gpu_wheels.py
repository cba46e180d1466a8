"""Build what a lent GPU machine needs to run orch with no package index: `make gpu-wheels`.

Into bench/wheels/ (ignored by git): orch's wheel, and the wheels of its dependencies and of its `job`
extra for CPython 3.12 on manylinux x86_64, at the versions this checkout's .venv runs, torch left out
(the machine has its own), and pip's wheel to install them with. The folder must stay under the 64 MiB
that a device run may carry; the set is checked to resolve for 3.12 without an index.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "bench" / "wheels"
CARRY_LIMIT_MIB = 64
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
          "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
          "--platform", "manylinux_2_17_x86_64", "--platform", "any", "--only-binary=:all:"]
LEFT_OUT = {"torch", "matplotlib"}


def name_of(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements() -> list[str]:
    """orch's dependencies and its `job` extra, but those left out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["job"]
    return [r for r in wanted if name_of(r) not in LEFT_OUT]


def pins() -> list[str]:
    """The versions this checkout's environment runs (what the tests ran), as pip constraints."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], check=True, capture_output=True,
                            text=True).stdout.splitlines()
    return [line for line in frozen if "==" in line and name_of(line) not in LEFT_OUT | {"orch"}]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def main() -> int:
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir(parents=True)
    constraints = WHEELS / "constraints.txt"
    constraints.write_text("\n".join(pins()) + "\n")
    (WHEELS / "requirements.txt").write_text("\n".join(requirements()) + "\n")
    pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(WHEELS), str(ROOT))
    pip("download", "--quiet", "--dest", str(WHEELS), *TARGET, "-c", str(constraints), "pip", *requirements())
    # Resolves for 3.12 from the folder alone, as the machine will (torch aside: it is the machine's).
    pip("install", "--quiet", "--dry-run", "--ignore-installed", "--no-index", "--find-links", str(WHEELS),
        "--target", str(WHEELS / "resolve-check"), *TARGET, "-c", str(constraints), *requirements())
    shutil.rmtree(WHEELS / "resolve-check", ignore_errors=True)
    sizes = sorted(((p.stat().st_size, p.name) for p in WHEELS.glob("*.whl")), reverse=True)
    total = sum(s for s, _ in sizes) / 2**20
    for size, name in sizes[:8]:
        print(f"{size / 2**20:7.1f} MiB  {name}")
    print(f"{len(sizes)} wheels, {total:.1f} MiB in {WHEELS.relative_to(ROOT)} (a device run carries {CARRY_LIMIT_MIB} MiB)")
    if total >= CARRY_LIMIT_MIB:
        print(f"too big to carry: {total:.1f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
