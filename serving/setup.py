"""The serving wheel keeps, of the two packages it shares with training, only the modules the serving path imports
(`tests/sglang_plugin/test_serving_import.py` checks that path imports nothing else of ours and no SpecForge)."""

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = {"pr_specforge": {"__init__", "config"}, "pr_specforge.data": {"__init__", "io"}}


class ServingModules(build_py):
    def find_package_modules(self, package, package_dir):
        found = super().find_package_modules(package, package_dir)
        keep = SHIPPED.get(package)
        return found if keep is None else [m for m in found if m[1] in keep]


setup(cmdclass={"build_py": ServingModules})
