"""How much shell orch keeps inside Python strings: counted from the source, so it can only shrink.

A line of shell is a source line of orchestrator/ or playbooks/ holding a string constant that reaches a
command a host's shell runs: the first argument of any `.run(...)` or `.stream(...)` call (an argv list
is no shell, and is skipped), followed through local and module names, the return values of functions of
orch's own modules, and their constants (`launch.WRAPPER`). A value passed through `quote(...)` is a
word of data, not shell, and is not followed. The job command a playbook builds is the job itself and
never reaches such a call: it travels to the host's agent in a request.

`python -m tests.fast.test_shell_lines` prints every counted line.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("orchestrator", "playbooks")
NOT_FOLLOWED = {"quote", "shlex.quote"}  # a quoted value is one word of data
# The most there may be; lower it when shell moves into the host's agent, never raise it.
CEILING = 7


class Module:
    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.tree = ast.parse(path.read_text(), str(path))
        self.functions = {n.name: n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.assigned = _assignments(self.tree.body)
        self.imports: dict[str, str] = {}  # local name -> "module" or "module:NAME"
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve_from(name, node)
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{base}:{alias.name}"


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    parts = module.split(".")
    if node.level:
        parts = parts[: len(parts) - node.level]  # a module's package, then up
        return ".".join(parts + ([node.module] if node.module else []))
    return node.module or ""


def _assignments(body: list[ast.stmt]) -> dict[str, list[ast.expr]]:
    """Every value a name is given in these statements (nested blocks included, nested functions not)."""
    found: dict[str, list[ast.expr]] = {}

    def visit(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(s, ast.Assign):
                for t in s.targets:  # `a, b = f()`: values of data (paths, digests), never shell here
                    if isinstance(t, ast.Name):
                        found.setdefault(t.id, []).append(s.value)
            elif isinstance(s, (ast.AugAssign, ast.AnnAssign)) and isinstance(s.target, ast.Name) and s.value:
                found.setdefault(s.target.id, []).append(s.value)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(s, field, None)
                if isinstance(inner, list):
                    visit([x for x in inner if isinstance(x, ast.stmt)] +
                          [y for h in inner if isinstance(h, ast.ExceptHandler) for y in h.body])
    visit(body)
    return found


class Counter:
    def __init__(self, modules: dict[str, Module] | None = None) -> None:
        """Over the given modules, or (none given) every module of orch's sources."""
        self.modules: dict[str, Module] = {} if modules is None else modules
        for top in SOURCES if modules is None else ():
            for path in sorted((ROOT / top).rglob("*.py")):
                if "hostjobs" in path.parts:
                    continue  # the host programs are Python, run by the host's python
                rel = path.relative_to(ROOT).with_suffix("")
                parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
                self.modules[".".join(parts)] = Module(".".join(parts), path)
        self.lines: set[tuple[str, int]] = set()
        self._seen: set[tuple[str, int]] = set()

    def count(self) -> set[tuple[str, int]]:
        for mod in self.modules.values():
            for call in (n for n in ast.walk(mod.tree) if isinstance(n, ast.Call)):
                if isinstance(call.func, ast.Attribute) and call.func.attr in ("run", "stream"):
                    arg = call.args[0] if call.args else next(
                        (k.value for k in call.keywords if k.arg == "command"), None)
                    if arg is not None and not isinstance(arg, (ast.List, ast.Tuple)):
                        self.follow(mod, arg, _scope(mod, call))
        return self.lines

    def follow(self, mod: Module, node: ast.AST, scope: dict[str, list[ast.expr]]) -> None:
        key = (f"{mod.name}:{id(scope)}", id(node))
        if key in self._seen:
            return
        self._seen.add(key)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            end = node.end_lineno or node.lineno
            self.lines.update((_shown(mod.path), n) for n in range(node.lineno, end + 1))
            return
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in NOT_FOLLOWED or name.endswith(".quote"):
                return
            functions = list(self.function(mod, node.func))
            for fn_mod, fn in functions:
                inner = _assignments(fn.body)
                for ret in (r for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None):
                    self.follow(fn_mod, ret.value, inner)
            if functions:
                return  # its arguments are its parameters' values: data, unless its body makes them shell
        if isinstance(node, ast.Name):
            for value in scope.get(node.id, []) or mod.assigned.get(node.id, []):
                self.follow(mod, value, scope)
            target = mod.imports.get(node.id)
            if target and ":" in target:
                other, const = target.split(":")
                if other in self.modules:
                    for value in self.modules[other].assigned.get(const, []):
                        self.follow(self.modules[other], value, {})
            return
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            other = self.module_of(mod, node.value.id)
            if other is not None:
                for value in other.assigned.get(node.attr, []):
                    self.follow(other, value, {})
                return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.follow(mod, child, scope)

    def module_of(self, mod: Module, name: str) -> Module | None:
        target = mod.imports.get(name)
        if target is None:
            return None
        base, _, leaf = target.partition(":")
        return self.modules.get(f"{base}.{leaf}") or None

    def function(self, mod: Module, func: ast.expr) -> Iterator[tuple[Module, ast.FunctionDef | ast.AsyncFunctionDef]]:
        if isinstance(func, ast.Name):
            if func.id in mod.functions:
                yield mod, mod.functions[func.id]
            target = mod.imports.get(func.id)
            if target and ":" in target:
                other, name = target.split(":")
                if other in self.modules and name in self.modules[other].functions:
                    yield self.modules[other], self.modules[other].functions[name]
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            other = self.module_of(mod, func.value.id)
            if other is not None and func.attr in other.functions:
                yield other, other.functions[func.attr]


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _scope(mod: Module, call: ast.Call) -> dict[str, list[ast.expr]]:
    """The names of the function around a call."""
    for fn in mod.functions.values():
        if fn.lineno <= call.lineno <= (fn.end_lineno or fn.lineno):
            inner = [f for f in ast.walk(fn) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f is not fn
                     and f.lineno <= call.lineno <= (f.end_lineno or f.lineno)]
            return _assignments((inner[-1] if inner else fn).body)
    return {}


def shell_lines() -> list[tuple[str, int]]:
    return sorted(Counter().count())


def test_shell_inside_python_strings_stays_under_its_ceiling():
    lines = shell_lines()
    by_file: dict[str, int] = {}
    for path, _ in lines:
        by_file[path] = by_file.get(path, 0) + 1
    assert len(lines) <= CEILING, f"{len(lines)} lines of shell in Python strings (ceiling {CEILING}): {by_file}"


def test_the_counter_sees_shell_through_names_functions_and_constants(tmp_path: Path):
    """A command built in a function from a module constant, passed through a name, is counted; a
    quoted word and an argv list are not."""
    src = ("from .remote import quote\n"
           "SCRIPT = 'echo one\\necho two'\n"
           "def build(x):\n"
           "    return SCRIPT + f' {quote(\"not shell\")}'\n"
           "def go(t):\n"
           "    cmd = build(1)\n"
           "    t.run(cmd)\n"
           "    t.run(['argv', 'list'])\n")
    path = tmp_path / "probe.py"
    path.write_text(src)
    counter = Counter({"orchestrator.probe": Module("orchestrator.probe", path)})
    found = {n for _, n in counter.count()}
    assert found == {2, 4}


if __name__ == "__main__":
    shown = shell_lines()
    for file, line in shown:
        text = (ROOT / file).read_text().splitlines()[line - 1]
        print(f"{file}:{line}: {text.strip()[:110]}")
    print(f"{len(shown)} lines", file=sys.stderr)
