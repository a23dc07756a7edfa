"""The extension shares the process's C++ runtime (CMakeLists.txt, "One C++ runtime").

On the H200 machine, a g++ that links libstdc++ statically put a second copy of the runtime into
hypershard._C beside the shared one torch uses; every fused attention call then died of a
segfault in `stream << long` (docs/gpu.md). The build now binds every libstdc++ symbol to the
shared library. This test reads the built module's dynamic symbol table: a copy linked in shows
as defined stream/locale symbols (100 of basic_ostream's in that build; checked by linking this
tree with -static-libstdc++ and without the CMake lines: the test fails with those counts).
"""

import shutil
import subprocess

import pytest

from hypershard import _C

# Symbols only a linked-in copy of libstdc++ defines (a module that uses the shared one imports them).
RUNTIME_SYMBOLS = ("std::basic_ostream", "std::locale::", "std::codecvt", "std::ios_base::")


def defined_symbols(path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    result = subprocess.run([nm, "-DC", "--defined-only", path], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def test_extension_defines_no_libstdcxx_runtime_symbols():
    lines = defined_symbols(_C.__file__)
    assert lines, "nm listed no dynamic symbols (PyInit__C at least must be there)"
    copied = {prefix: sum(prefix in line for line in lines) for prefix in RUNTIME_SYMBOLS}
    assert not any(copied.values()), (
        f"{_C.__file__} defines libstdc++ runtime symbols {copied}: a second C++ runtime was "
        "linked in (see CMakeLists.txt, 'One C++ runtime')"
    )


def test_extension_imports_its_stream_inserters():
    # the positive side: `stream << long` resolves to the shared libstdc++ (undefined here)
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    undefined = subprocess.run([nm, "-DC", "--undefined-only", _C.__file__], capture_output=True, text=True, check=True)
    assert "std::ostream::_M_insert<long>(long)" in undefined.stdout
