"""The ctypes view of the C API (``kvstage/_lib.py``) against ``include/kvstage.h``.

- Every ``typedef struct`` of the header has a ``ctypes.Structure`` of the same name in ``_lib``
  and the other way round, with the same fields in the same order, each of the same kind (the
  scalar type, a pointer, a nested struct, a char array of the same length). Its ``sizeof`` and
  every field's offset and size equal the C compiler's (a small C program that includes the
  header, compiled with ``cc``; skipped without a C compiler) and those of a ctypes mirror built
  from the header's declarations (always).
- Every function the binding declares is declared by the header with the same return and
  argument types, and every function of the header is bound (or listed as deliberately not).
- The binding's enums and constants have the header's values.

These need no library: they read the header of this checkout (skipped where it is absent, e.g.
an installed package).
"""

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from kvstage import _lib, _logging

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.normpath(os.path.join(HERE, os.pardir, os.pardir, "include"))
HEADER = os.path.join(INCLUDE, "kvstage.h")

pytestmark = pytest.mark.skipif(not os.path.exists(HEADER), reason="include/kvstage.h is not in this tree")

#: Header functions the binding does not declare, and why.
NOT_BOUND = {
    "kvstage_testing_rdma_fault": "test builds only: drives RDMA fault injection of the Rust tests",
}

SCALARS = {
    "size_t": ctypes.c_size_t,
    "uint8_t": ctypes.c_uint8,
    "uint16_t": ctypes.c_uint16,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "int8_t": ctypes.c_int8,
    "int16_t": ctypes.c_int16,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "char": ctypes.c_char,
}


def _read_header() -> str:
    with open(HEADER, encoding="utf-8") as f:
        text = f.read()
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


TEXT = _read_header() if os.path.exists(HEADER) else ""


def _defines() -> dict:
    out = {}
    for name, value in re.findall(r"^#define (KVSTAGE_\w+) (.+)$", TEXT, re.M):
        value = value.strip()
        if re.fullmatch(r"-?\d+", value):
            out[name] = int(value)
        elif value == "UINT64_MAX":
            out[name] = (1 << 64) - 1
    return out


DEFINES = _defines()


class CType:
    """A parsed C type: a pointer (to ``target``, ``None`` for void or an opaque handle), a
    scalar, a struct, an enum (an int), a function pointer typedef, or an array of ``length``."""

    def __init__(self, text: str, length: int = 0):
        text = " ".join(text.replace("*", " * ").split())
        self.text = text
        self.length = length
        words = [w for w in text.split() if w != "const"]
        self.pointer = words.count("*")
        words = [w for w in words if w != "*"]
        self.target = None  # a struct name pointed to or embedded
        if words[0] == "struct":
            self.base = "struct"
            self.target = words[1]
        elif words[0] == "enum":
            self.base = "enum"
            self.target = words[1]
        elif words[0] in SCALARS or words[0] == "void":
            self.base = words[0]
        elif words[0].endswith("_fn"):
            self.base = "fn"
            self.target = words[0]
        else:
            self.base = "typedef"
            self.target = words[0]

    def mirror(self, structs: dict):
        """The ctypes type of this C type, for offsets (pointers are all ``c_void_p``)."""
        if self.pointer or self.base == "fn":
            t = ctypes.c_void_p
        elif self.base == "enum":
            t = ctypes.c_int
        elif self.base in ("struct", "typedef"):
            t = structs[self.target]
        else:
            t = SCALARS[self.base]
        return t * self.length if self.length else t

    def __repr__(self):
        return self.text + (f"[{self.length}]" if self.length else "")


def _parse_decl(decl: str):
    """``"const uint32_t *layer_ids"`` -> ("layer_ids", CType); arrays sized by a literal or a
    ``#define``."""
    m = re.fullmatch(r"(.*?)\b(\w+)\s*(?:\[\s*(\w+)\s*\])?", " ".join(decl.split()))
    assert m, decl
    ctype, name, size = m.groups()
    length = 0
    if size:
        length = int(size) if size.isdigit() else DEFINES[size]
    return name, CType(ctype, length)


def _header_structs() -> dict:
    """Every struct with a body, in header order: name -> [(field, CType)]."""
    structs = {}
    for name, body, alias in re.findall(r"typedef struct (\w+) \{(.*?)\} (\w+);", TEXT, re.S):
        assert name == alias, f"typedef struct {name} {{...}} {alias}"
        structs[name] = [_parse_decl(d) for d in body.split(";") if d.strip()]
    return structs


def _header_functions() -> dict:
    """Every function declaration: name -> (return CType, [CType])."""
    functions = {}
    for ret, name, params in re.findall(r"^([A-Za-z_][\w \*]*?)\s*\b(kvstage_\w+)\(([^;{]*)\);", TEXT, re.M | re.S):
        params = " ".join(params.split())
        args = [] if params in ("", "void") else [_parse_decl(p)[1] for p in params.split(",")]
        functions[name] = (CType(ret), args)
    return functions


def _binding_structs() -> dict:
    return {
        name: obj
        for name, obj in vars(_lib).items()
        if isinstance(obj, type) and issubclass(obj, ctypes.Structure) and obj.__module__ == _lib.__name__
    }


def _mirrors(header: dict) -> dict:
    """A ctypes struct per header struct, built from the header's declarations alone."""
    built: dict = {}
    for name, fields in header.items():  # the header defines a struct before its users
        built[name] = type(name, (ctypes.Structure,), {"_fields_": [(f, t.mirror(built)) for f, t in fields]})
    return built


def _is_pointer(t) -> bool:
    return t in (ctypes.c_void_p, ctypes.c_char_p) or (isinstance(t, type) and issubclass(t, (ctypes._Pointer, ctypes._CFuncPtr)))


def _kind_problem(got, want: CType) -> str:
    """Why the binding's ctypes type ``got`` does not stand for the C type ``want`` ("" if it does)."""
    if want.length:
        if not (isinstance(got, type) and issubclass(got, ctypes.Array)):
            return f"{got} is not an array"
        if got._length_ != want.length:
            return f"array of {got._length_}, the header's has {want.length}"
        return _kind_problem(got._type_, CType(want.text))
    if want.base == "fn":
        return "" if got is getattr(_lib, want.target, None) else f"{got} is not _lib.{want.target}"
    if want.pointer:
        if not _is_pointer(got):
            return f"{getattr(got, '__name__', got)} is not a pointer"
        if want.pointer == 1 and want.base in ("struct", "typedef") and isinstance(got, type) and issubclass(got, ctypes._Pointer):
            # A pointer to a struct the binding mirrors must point to that mirror (handles are
            # opaque: c_void_p); one to a scalar must point to that scalar.
            if got._type_.__name__ != want.target:
                return f"points to {got._type_.__name__}, the header's to {want.target}"
        if want.pointer == 1 and want.base in SCALARS and isinstance(got, type) and issubclass(got, ctypes._Pointer):
            if got._type_ is not SCALARS[want.base]:
                return f"points to {got._type_.__name__}, the header's to {want.base}"
        if want.base == "char" and want.pointer == 1 and got is not ctypes.c_char_p:
            return f"{got} for a char pointer (expected c_char_p)"
        return ""
    if want.base == "void":
        return "" if got is None else f"{got} for void"
    if want.base in ("struct", "typedef"):
        return "" if isinstance(got, type) and got.__name__ == want.target else f"{got} is not struct {want.target}"
    if want.base == "enum":
        return "" if got is ctypes.c_int else f"{got} for enum {want.target} (expected c_int)"
    return "" if got is SCALARS[want.base] else f"{getattr(got, '__name__', got)} for {want.base}"


def _compiler():
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compiled_layout(structs: dict, tmp_path) -> dict:
    """sizeof of every struct and (offset, size) of every field, as the C compiler lays them out:
    ``{"name": (sizeof,), "name.field": (offset, size)}``."""
    cc = _compiler()
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "kvstage.h"', "int main(void) {"]
    for name, fields in structs.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in fields:
            lines.append(f'    printf("{name}.{field} %zu %zu\\n", offsetof({name}, {field}), sizeof((({name} *)0)->{field}));')
    lines += ["    return 0;", "}"]
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    built = subprocess.run([cc, "-std=c11", "-I", INCLUDE, "-o", str(exe), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, f"{cc} failed on the header:\n{built.stderr}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    layout = {}
    for line in out.splitlines():
        key, *values = line.split()
        layout[key] = tuple(int(v) for v in values)
    return layout


def _mirror_layout(structs: dict) -> dict:
    """The same, from a ctypes mirror of the header's declarations (no compiler needed)."""
    mirrors = _mirrors(structs)
    layout = {}
    for name, fields in structs.items():
        layout[name] = (ctypes.sizeof(mirrors[name]),)
        for field, _ in fields:
            layout[f"{name}.{field}"] = (getattr(mirrors[name], field).offset, getattr(mirrors[name], field).size)
    return layout


@pytest.mark.parametrize("truth", ["cc", "header types"])
def test_every_struct_matches_the_header(truth, tmp_path):
    """Names, order and kinds of the fields from the header's text; sizeof and every field's offset
    and size from the C compiler ("cc", skipped without one) or from the header's field types."""
    header = _header_structs()
    binding = _binding_structs()
    assert len(header) >= 20, f"parsed only {sorted(header)} from the header"
    assert sorted(binding) == sorted(header), (
        f"structs only in the header: {sorted(set(header) - set(binding))}; only in _lib.py: {sorted(set(binding) - set(header))}"
    )
    if truth == "cc":
        if not _compiler():
            pytest.skip("no C compiler (cc, gcc, clang or $CC): the 'header types' case checks the layout")
        layout = _compiled_layout(header, tmp_path)
        # The mirror (what the other case concludes without a compiler) agrees with the compiler.
        assert _mirror_layout(header) == layout, "the header parse of this test is wrong"
    else:
        layout = _mirror_layout(header)
    problems = []
    for name, fields in header.items():
        got = binding[name]
        got_names = [f[0] for f in got._fields_]
        want_names = [f for f, _ in fields]
        if got_names != want_names:
            problems.append(f"{name}: fields {got_names}, the header's {want_names}")
            continue
        for (field, ctype), (_, got_type) in zip(fields, got._fields_):
            problem = _kind_problem(got_type, ctype)
            if problem:
                problems.append(f"{name}.{field} ({ctype!r}): {problem}")
        if (ctypes.sizeof(got),) != layout[name]:
            problems.append(f"sizeof({name}): {ctypes.sizeof(got)} in _lib.py, {layout[name][0]} by {truth}")
        for field, _ in fields:
            descr = getattr(got, field)
            if (descr.offset, descr.size) != layout[f"{name}.{field}"]:
                problems.append(f"{name}.{field}: offset, size {(descr.offset, descr.size)} in _lib.py, {layout[f'{name}.{field}']} by {truth}")
    assert not problems, "\n".join(problems)


def test_every_prototype_matches_the_header():
    functions = _header_functions()
    assert len(functions) >= 50, f"parsed only {len(functions)} functions from the header"
    declared = dict(_lib.PROTOTYPES)
    declared.update(_lib.OPTIONAL_PROTOTYPES)
    problems = []
    for name, (restype, argtypes) in declared.items():
        if name not in functions:
            problems.append(f"{name}: not in the header")
            continue
        ret, args = functions[name]
        problem = _kind_problem(restype, ret)
        if problem:
            problems.append(f"{name} returns {ret!r}: {problem}")
        if len(argtypes) != len(args):
            problems.append(f"{name}: {len(argtypes)} arguments in _lib.py, {len(args)} in the header {args}")
            continue
        for i, (got, want) in enumerate(zip(argtypes, args)):
            problem = _kind_problem(got, want)
            if problem:
                problems.append(f"{name} argument {i} ({want!r}): {problem}")
    unbound = sorted(set(functions) - set(declared) - set(NOT_BOUND))
    if unbound:
        problems.append(f"header functions the binding does not declare (bind them or add them to NOT_BOUND): {unbound}")
    stale = sorted(set(NOT_BOUND) - set(functions))
    if stale:
        problems.append(f"NOT_BOUND names functions the header no longer has: {stale}")
    assert not problems, "\n".join(problems)


def _enumerators() -> dict:
    """Every enumerator of the header's enums: C name -> value."""
    out = {}
    for body in re.findall(r"typedef enum \w+ \{(.*?)\}", TEXT, re.S):
        for name, value in re.findall(r"(KVSTAGE_\w+)\s*=\s*(-?\d+)", body):
            out[name] = int(value)
    return out


@pytest.mark.parametrize(
    "py_enum, prefix",
    [
        (_lib.ErrorClass, "KVSTAGE_CLASS_"),
        (_lib.Transport, "KVSTAGE_TRANSPORT_"),
        (_lib.ModelKind, "KVSTAGE_MODEL_"),
        (_lib.MemoryKind, "KVSTAGE_MEMORY_"),
        (_lib.LayoutPreset, "KVSTAGE_LAYOUT_"),
        (_lib.CompletionKind, "KVSTAGE_COMPLETION_"),
        (_lib.RoomEventKind, "KVSTAGE_ROOM_EVENT_"),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_enums_have_the_header_values(py_enum, prefix):
    c = {name: value for name, value in _enumerators().items() if name.startswith(prefix)}
    py = {prefix + m.name: int(m) for m in py_enum}
    assert py == c, f"{py_enum.__name__}: binding {py}, header {c}"


def test_status_codes_log_levels_and_constants_have_the_header_values():
    body = re.search(r"typedef enum kvstage_status \{(.*?)\}", TEXT, re.S).group(1)
    c = {name: int(value) for name, value in re.findall(r"(KVSTAGE_\w+)\s*=\s*(-?\d+)", body)}
    assert {s.c_name: int(s) for s in _lib.Status} == c
    levels = {name: value for name, value in _enumerators().items() if name.startswith("KVSTAGE_LOG_")}
    assert {f"KVSTAGE_LOG_{n}": getattr(_logging, f"LOG_{n}") for n in ("OFF", "ERROR", "WARN", "INFO", "DEBUG", "TRACE")} == levels
    assert DEFINES["KVSTAGE_TIMEOUT_INFINITE"] == _lib.TIMEOUT_INFINITE == (1 << 64) - 1
    assert DEFINES["KVSTAGE_TRACE_ID_SIZE"] == _lib.TRACE_ID_SIZE
    version = "%d.%d.%d" % tuple(DEFINES[f"KVSTAGE_VERSION_{p}"] for p in ("MAJOR", "MINOR", "PATCH"))
    assert version == _lib.__version__, f"the header is {version}, the package {_lib.__version__}"
