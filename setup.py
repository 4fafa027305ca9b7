"""The build records the commit it was built from in the installed package (tokenyard/_build_info.py), so that
a benchmark run from a `pip install .` names its code (tokenyard.tools.bench.report.git_commit). Everything
else about the package is in pyproject.toml."""

import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithCommit(build_py):
    def run(self):
        super().run()
        try:
            done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                  capture_output=True, text=True, timeout=10)
            commit = done.stdout.strip() if done.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (an sdist)
            commit = ""
        target = os.path.join(self.build_lib, "tokenyard", "_build_info.py")
        with open(target, "w") as f:
            f.write('"""Written by setup.py when the package was built."""\n\n'
                    f"COMMIT = {commit or None!r}\n")


setup(cmdclass={"build_py": BuildPyWithCommit})
