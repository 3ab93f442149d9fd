"""Parts own their state and are wired once, at construction (issue 23), checked on the
source of `server/tierckptd` and `client/tierckpt` with an AST walk (as the import rules
are): no statement writes an attribute into another object.

The rule: an assignment (`=`, `+=`, annotated) to `<expr>.attr` passes only when
1. it is the object's own state: `self.attr`, `cls.attr` or `<EnclosingClass>.attr`
   (one level: `self.part.attr = ...` writes into the part, not into self); or
2. it is the module's own state: the object is a private module-level name of the same
   module (`_LIVE.peers = ...` in ops/metrics.py); or
3. the object is a record being filled, not a part: `attr` is a field of a dataclass
   defined in the two packages (`CheckpointRecord.state`, `FileRecord.held`, a
   `Segment`, a reply being built...), or one of the fields of outside records and
   per-thread state in `OUTSIDE_RECORDS`, each listed with the file that writes it and
   why. A field name that is also a hook a part holds (an attribute its `__init__` sets
   to a lambda, or annotates as a `Callable`, `Listeners` or `Answer`) does not count as
   a record field, so a part's callback can never pass as one.

The rule goes by names, not types: a dataclass field name written into a part would pass
(review catches that; the hooks the issue removed are not dataclass fields).

Everything else is a part written from outside, the coupling the issue removed: a part
built later than another hears from it through the other's listener registry
(`tierckptd.ops.events`, subscribed with a method call) or gets its collaborators in its
constructor; settings that change at run time change through a method.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCES = (ROOT / "server" / "tierckptd", ROOT / "client" / "tierckpt")
GENERATED = ROOT / "client" / "tierckpt" / "v1"

# (file relative to the repository, attribute): records and per-thread state from outside
# the two packages' dataclasses, written where they are filled.
OUTSIDE_RECORDS: dict[tuple[str, str], str] = {
    ("server/tierckptd/peers/bulk_wire.py", "minimum_version"): "an ssl.SSLContext, set up",
    ("server/tierckptd/peers/bulk_wire.py", "verify_mode"): "an ssl.SSLContext, set up",
    ("client/tierckpt/dcp_metadata.py", "maxstring"): "a module-private reprlib.Repr, set up",
    ("client/tierckpt/dcp_metadata.py", "maxother"): "a module-private reprlib.Repr, set up",
    ("client/tierckpt/dcp_metadata.py", "maxlevel"): "a module-private reprlib.Repr, set up",
    ("client/tierckpt/cli.py", "done_bytes"): "a tqdm-like progress bar's counter",
    ("client/tierckpt/sagemaker_import.py", "storage_data"): "DCP's Metadata record",
    ("client/tierckpt/storage_reader.py", "storage_meta"): "DCP's Metadata record",
    ("client/tierckpt/storage_reader.py", "load_id"): "DCP's StorageMeta record",
    ("client/tierckpt/storage_writer.py", "storage_data"): "DCP's Metadata record",
    ("client/tierckpt/storage_writer.py", "storage_meta"): "DCP's Metadata record",
    ("client/tierckpt/storage_writer.py", "version"): "DCP's Metadata record",
    ("server/tierckptd/persistent/decode_child.py", "storage_data"): "DCP's Metadata record",
    ("server/tierckptd/ops/priority.py", "set"): "a per-thread flag (threading.local)",
    ("server/tierckptd/persistent/store.py", "retries"): "the fsspec client being set up",
    ("server/tierckptd/persistent/store.py", "closed"): "an fsspec buffered file abandoned",
    ("server/tierckptd/rpc/daemon_service.py", "mark_peers_applied"): "a protobuf reply",
    ("server/tierckptd/rpc/peer_guard.py", "experimental_non_blocking"): "grpc's handler flag",
    ("server/tierckptd/rpc/peer_guard.py", "experimental_thread_pool"): "grpc's handler flag",
}


@dataclass(frozen=True)
class Write:
    path: str
    line: int
    target: str
    attr: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.target} = ..."


def _files() -> list[Path]:
    return [p for root in SOURCES for p in sorted(root.rglob("*.py")) if GENERATED not in p.parents]


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if name == "dataclass":
            return True
    return False


HOOK_TYPES = ("Callable", "Listeners", "Answer")


def _is_hook(node: ast.AST) -> bool:
    """An `__init__` statement that sets a callback: a lambda, or annotated as one."""
    if isinstance(node, ast.AnnAssign):
        return any(t in ast.unparse(node.annotation) for t in HOOK_TYPES)
    return isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda)


def _record_fields(trees: list[ast.Module]) -> set[str]:
    """Fields of the two packages' dataclasses, less every hook a part (a non-dataclass
    class) sets on itself in its `__init__`."""
    fields: set[str] = set()
    part_attrs: set[str] = set()
    for tree in trees:
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            if _is_dataclass(cls):
                fields |= {
                    s.target.id
                    for s in cls.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                continue
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    for node in ast.walk(fn):
                        if not _is_hook(node):
                            continue
                        for target in _targets(node):
                            if (
                                isinstance(target, ast.Attribute)
                                and isinstance(target.value, ast.Name)
                                and target.value.id == "self"
                            ):
                                part_attrs.add(target.attr)
    return fields - part_attrs


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found: list[ast.expr] = []
        for t in node.targets:
            found.extend(t.elts if isinstance(t, ast.Tuple | ast.List) else [t])
        return found
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def writes_into_others(source: str, path: str, record_fields: set[str]) -> list[Write]:
    """The attribute writes of `source` that the rule (module docstring) refuses."""
    found: list[Write] = []
    tree = ast.parse(source, path)
    private = {
        t.id
        for node in tree.body
        for t in _targets(node)
        if isinstance(t, ast.Name) and t.id.startswith("_")
    }

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            visit(child, child.name if isinstance(child, ast.ClassDef) else owner)
        for target in _targets(node):
            if not isinstance(target, ast.Attribute):
                continue
            base = target.value
            own = isinstance(base, ast.Name) and base.id in ("self", "cls", owner, *private)
            if own or target.attr in record_fields:
                continue
            if (path, target.attr) in OUTSIDE_RECORDS:
                continue
            found.append(Write(path, node.lineno, ast.unparse(target), target.attr))

    visit(tree, "")
    return found


@pytest.fixture(scope="module")
def parsed() -> list[tuple[str, str, ast.Module]]:
    return [
        (str(p.relative_to(ROOT)), (text := p.read_text()), ast.parse(text, str(p)))
        for p in _files()
    ]


@pytest.fixture(scope="module")
def record_fields(parsed: list[tuple[str, str, ast.Module]]) -> set[str]:
    return _record_fields([tree for _, _, tree in parsed])


def test_no_part_is_written_from_outside(
    parsed: list[tuple[str, str, ast.Module]], record_fields: set[str]
) -> None:
    found = [w for path, text, _ in parsed for w in writes_into_others(text, path, record_fields)]
    assert not found, "attributes written into another object:\n" + "\n".join(map(str, found))


def test_every_outside_record_is_still_written(
    parsed: list[tuple[str, str, ast.Module]], record_fields: set[str]
) -> None:
    """The exception list does not outlive the code it excuses."""
    written = {
        (path, w.attr)
        for path, text, _ in parsed
        for w in writes_into_others(text, path, record_fields - {a for _, a in OUTSIDE_RECORDS})
    }
    written |= {
        (path, t.attr)
        for path, _, tree in parsed
        for node in ast.walk(tree)
        for t in _targets(node)
        if isinstance(t, ast.Attribute)
    }
    assert set(OUTSIDE_RECORDS) <= written, set(OUTSIDE_RECORDS) - written


@pytest.mark.parametrize(
    ("source", "refused"),
    [
        ("def wire(catalog, drainer):\n    catalog.on_committed = drainer.enqueue", True),
        ("class A:\n    def __init__(self, c):\n        self.c = c\n        c.hook = self", True),
        ("class A:\n    def f(self):\n        self.part.limit = 3", True),
        ("def f(cluster):\n    cluster.ops.unstore = None", True),
        ("class A:\n    def f(self):\n        self.limit = 3", False),
        ("class A:\n    def f(self):\n        A.warned = True", False),
        ("def f(rec):\n    rec.state = 1", False),  # a record field
        ("def f(x):\n    x.state = 1", False),
    ],
)
def test_the_rule_refuses_writes_into_parts(source: str, refused: bool) -> None:
    """Not vacuous: the walk finds a hook, a part's setting and a nested part written
    from outside, and lets own state and record fields pass."""
    fields = {"state"}
    assert bool(writes_into_others(source, "example.py", fields)) is refused


def test_a_part_attribute_is_never_taken_for_a_record_field() -> None:
    source = (
        "from dataclasses import dataclass\n"
        "@dataclass\nclass R:\n    hook: int = 0\n    size: int = 0\n"
        "class Part:\n    def __init__(self):\n"
        "        self.hook: Callable[[], None] | None = None\n        self.size = 0\n"
    )
    assert _record_fields([ast.parse(source)]) == {"size"}
