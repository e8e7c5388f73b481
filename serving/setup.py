"""The serving wheel keeps, of the two packages it shares with training, only the modules the serving path imports
(`tests/sglang_plugin/test_serving_import.py` checks that path imports nothing else of ours and no SpecForge).

The build writes nothing into the source tree: setuptools would put its `build/` next to this file and, the package
directory being `..`, `pr_specforge_serve.egg-info/` at the repository's root; both go to a temporary directory of
this build process instead, removed when it exits (the wheel and pip's metadata are written where pip asks)."""

import atexit
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = {"pr_specforge": {"__init__", "config", "local_server", "op_parts"}, "pr_specforge.data": {"__init__", "io"}}


class ServingModules(build_py):
    def find_package_modules(self, package, package_dir):
        found = super().find_package_modules(package, package_dir)
        keep = SHIPPED.get(package)
        return found if keep is None else [m for m in found if m[1] in keep]


scratch = tempfile.mkdtemp(prefix="pr_specforge_serve_build.")
atexit.register(shutil.rmtree, scratch, ignore_errors=True)
setup(cmdclass={"build_py": ServingModules},
      options={"build": {"build_base": f"{scratch}/build"}, "egg_info": {"egg_base": scratch}})
