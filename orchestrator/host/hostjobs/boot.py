"""How the host side reaches a host and starts there: one zip archive of this package, made the same way from
the same sources (so its sha256 names the version), and the bootstrap that runs it.

The archive is placed in a workdir that other users may share, so the file found there is never simply
run: the bootstrap reads its bytes once, checks their sha256 against the version asked for, and imports
this package's modules from exactly those bytes in memory (a finder first on sys.meta_path); the file is
never opened again, so one swapped after the check never runs. Before anything is imported, sys.path keeps
only absolute folders: neither the folder it is started in (`-c` puts it first, as '') nor any other
relative entry can shadow a module (a `hashlib.py` planted in a run dir). Every module it loads learns
the archive's path and digest as ORCH_ARCHIVE (the job wrappers are started through the bootstrap too).
"""

import io
import os

MISSING = 97  # the bootstrap's exit status when the archive is absent or not the expected version
PACKAGE = "hostjobs"  # the package's name inside the archive, on the host
STAMP = (1980, 1, 1, 0, 0, 0)  # every member's time: the archive depends on the sources alone

# argv: the archive's path, its sha256, then the arguments of the package's main().
BOOTSTRAP = (
    "import sys\n"
    "sys.path[:] = [x for x in sys.path if x.startswith('/')]\n"
    "import hashlib, importlib.util, io, zipfile\n"
    "p, want = sys.argv[1], sys.argv[2]\n"
    "try:\n"
    "    with open(p, 'rb') as f: data = f.read()\n"
    "except OSError: sys.exit(97)\n"
    "if hashlib.sha256(data).hexdigest() != want: sys.exit(97)\n"
    "z = zipfile.ZipFile(io.BytesIO(data))\n"
    "names = set(z.namelist())\n"
    "class Archive:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        for member, package in ((name.replace('.', '/') + '/__init__.py', True), (name.replace('.', '/') + '.py', False)):\n"
    "            if name.split('.')[0] == 'hostjobs' and member in names:\n"
    "                return importlib.util.spec_from_loader(name, self, origin=member, is_package=package)\n"
    "    def create_module(self, spec): return None\n"
    "    def exec_module(self, module):\n"
    "        module.ORCH_ARCHIVE = (p, want)\n"
    "        exec(compile(z.read(module.__spec__.origin), p + '/' + module.__spec__.origin, 'exec'), module.__dict__)\n"
    "sys.meta_path.insert(0, Archive())\n"
    "from hostjobs.main import main\n"
    "sys.exit(main(sys.argv[3:]))\n"
)


# The package run from its sources (on orch's own machine, where nothing is placed): argv is the folder that
# holds `orchestrator/`, then the arguments of main().
SOURCES_RUN = ("import sys; sys.path.insert(0, sys.argv[1]); from orchestrator.host.hostjobs.main import main; "
               "sys.exit(main(sys.argv[2:]))")


def sources(folder=None):
    """(name in the archive, bytes) of each module of this package, in name order."""
    folder = folder or os.path.dirname(os.path.abspath(__file__))
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    out = []
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            out.append((f"{PACKAGE}/{name}", f.read()))
    return out


def archive(folder=None):
    """The package as one zip: members in name order, stored (no compressor's version in the bytes), each
    with the same time and mode, so the same sources give the same bytes and sha256."""
    import zipfile  # here: the controller imports this module for BOOTSTRAP at start-up, zipfile only to ship

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in sources(folder):
            info = zipfile.ZipInfo(name, STAMP)
            info.create_system = 3  # unix, whatever this machine is
            info.external_attr = 0o644 << 16
            z.writestr(info, data)
    return buf.getvalue()
