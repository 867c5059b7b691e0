"""The compiler that links a CPU library built for another architecture (compiled here, run there).

TVM's export_library links with the host's g++, which cannot link aarch64 objects; an export whose plan
names another architecture links with that architecture's cross compiler (Debian's gcc-aarch64-linux-gnu),
and a missing one is a TargetError naming the package, not g++'s "file in wrong format".
"""

from __future__ import annotations

import shutil

from souffle_py.cpu_features import host_arch
from souffle_py.errors import TargetError

# architecture -> (its Linux cross compiler, the Debian/Ubuntu package that has it)
CROSS_COMPILERS = {"aarch64": ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
                   "x86_64": ("x86_64-linux-gnu-gcc", "gcc-x86-64-linux-gnu")}


def library_compiler(arch: str):
    """The `fcompile` for TVM's export_library of a library built for `arch`: None (TVM's default) for this
    machine's architecture, else the cross compiler."""
    if not arch or arch == host_arch():
        return None
    if arch not in CROSS_COMPILERS:
        raise TargetError(f"cannot link a library for {arch} CPUs on this {host_arch()} machine: souffle-py knows "
                          f"cross compilers for {', '.join(sorted(CROSS_COMPILERS))} only")
    compiler, package = CROSS_COMPILERS[arch]
    if shutil.which(compiler) is None:
        raise TargetError(f"linking the library built for {arch} CPUs needs the cross compiler {compiler}, which "
                          f"this machine lacks: install it (Debian/Ubuntu: apt-get install {package})")
    from tvm.support import cc  # TVM 0.27 (tvm.contrib.cc before)

    return cc.cross_compiler(compiler)
