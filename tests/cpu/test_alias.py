"""`python -m tokenyard.compat.alias`, in fresh virtual environments that see this interpreter's packages (torch):
after `install`, `import deep_ep` gives tokenyard, as Megatron-LM, SGLang and vLLM look for it; beside a real
DeepEP it refuses and writes nothing; `uninstall` removes what it wrote; `--target` makes the folder it names."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig

import pytest

from tokenyard.compat import alias

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _site_folders() -> list:
    """This interpreter's site-packages (a virtual environment's, where it runs in one, and the user's), which a
    nested `venv --system-site-packages` would not see: that sees the base interpreter's only."""
    folders = list(site.getsitepackages()) + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    return [f for f in dict.fromkeys(folders) if os.path.isdir(f)]


def _env(**overrides) -> dict:
    """The environment of a command in the test's virtual environment: without PYTHONPATH, which would put a
    source tree (this checkout, say) before the installed copy the tests are about."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(overrides)
    return env


def _venv(path) -> str:
    """A virtual environment at `path` with tokenyard installed from this checkout, seeing this interpreter's
    packages (a .pth file of its site-packages, after the environment's own); -> its python."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True)
    python = os.path.join(str(path), "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, env=_env()).stdout.strip()
    with open(os.path.join(purelib, "test_alias_outer_site.pth"), "w") as f:
        f.write("".join(folder + "\n" for folder in _site_folders()))
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", ROOT],
                   check=True, capture_output=True, env=_env())
    return python


def _run(python, *args, cwd, env=None):
    return subprocess.run([python, *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env=_env() if env is None else env)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    path = tmp_path_factory.mktemp("venv")
    return _venv(path), str(tmp_path_factory.mktemp("elsewhere"))


def _site(python, cwd) -> str:
    return _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=cwd).stdout.strip()


def test_after_install_import_deep_ep_gives_tokenyard_and_uninstall_removes_it(venv):
    python, cwd = venv  # a folder outside the checkout: the installed tokenyard, not the source tree
    before = _run(python, "-c", "import importlib.util; print(importlib.util.find_spec('deep_ep'))", cwd=cwd)
    assert before.stdout.strip() == "None", before
    done = _run(python, "-m", "tokenyard.compat.alias", "install", cwd=cwd)
    assert done.returncode == 0, done.stderr
    check = ("import deep_ep, deep_ep.buffer, tokenyard, tokenyard.compat.deep_ep as c\n"
             "from deep_ep import Buffer, Config, EventOverlap\n"
             "assert Buffer is tokenyard.Buffer and deep_ep.buffer is c.buffer and deep_ep.utils is c.utils\n"
             "assert deep_ep.AutoTuner is tokenyard.AutoTuner\n"
             # DeepEP main's layout, one module under both names
             "import deep_ep.buffers.legacy, deep_ep.buffers.elastic, deep_ep.utils.event, deep_ep.utils.envs\n"
             "from deep_ep.buffers.elastic import ElasticBuffer, EPHandle\n"
             "from deep_ep.utils.envs import get_physical_domain_size\n"
             "assert deep_ep.buffers.legacy is c.buffers.legacy and deep_ep.utils.event is c.utils.event\n"
             "assert ElasticBuffer is tokenyard.ElasticBuffer and deep_ep.buffers.legacy.Buffer is tokenyard.Buffer\n"
             "assert get_physical_domain_size is c.get_physical_domain_size\n"
             "print(deep_ep.TOKENYARD_ALIAS, tokenyard.__file__)")
    found = _run(python, "-c", check, cwd=cwd)
    assert found.returncode == 0, found.stderr
    assert found.stdout.startswith("True") and ROOT not in found.stdout.split()[1], found.stdout
    usage = _run(python, "-m", "deep_ep.benchmark", "--help", cwd=cwd)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m deep_ep.benchmark"), usage
    assert _run(python, "-m", "tokenyard.compat.alias", "install", cwd=cwd).returncode == 0  # again: replaced
    gone = _run(python, "-m", "tokenyard.compat.alias", "uninstall", cwd=cwd)
    assert gone.returncode == 0 and "removed" in gone.stdout, gone
    after = _run(python, "-c", "import importlib.util; print(importlib.util.find_spec('deep_ep'))", cwd=cwd)
    assert after.stdout.strip() == "None", after


def test_beside_a_real_deep_ep_install_refuses_and_writes_nothing(venv):
    python, cwd = venv
    real = os.path.join(_site(python, cwd), "deep_ep")
    os.makedirs(real)
    try:
        with open(os.path.join(real, "__init__.py"), "w") as f:
            f.write("REAL = True\n")
        done = _run(python, "-m", "tokenyard.compat.alias", "install", cwd=cwd)
        assert done.returncode == 1 and "refused" in done.stderr and "real DeepEP" in done.stderr, done
        assert os.listdir(real) == ["__init__.py"], "the real package was touched"
        kept = _run(python, "-m", "tokenyard.compat.alias", "uninstall", cwd=cwd)
        assert kept.returncode == 1 and "not tokenyard's alias" in kept.stderr, kept
        assert _run(python, "-c", "import deep_ep; print(deep_ep.REAL)", cwd=cwd).stdout.strip() == "True"
    finally:
        for name in os.listdir(real):
            os.unlink(os.path.join(real, name))
        os.rmdir(real)


def test_an_installed_copy_names_the_commit_it_was_built_from(venv):
    python, cwd = venv  # `pip install .` of this checkout (not editable); run from elsewhere
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not run from a git checkout")
    found = _run(python, "-c", "from tokenyard.tools.bench.report import git_commit; print(git_commit())",
                 cwd=cwd, env={k: v for k, v in _env().items() if k != "TOKENYARD_COMMIT"})
    assert found.returncode == 0 and found.stdout.strip() == head.stdout.strip(), found


def test_install_with_a_target_makes_the_folder(tmp_path):
    """`install --target DIR` where DIR does not exist yet (issue 47): made, the alias written there; `uninstall`
    removes the alias and leaves the folder."""
    target = tmp_path / "not" / "yet"
    assert alias.main(["install", "--target", str(target)]) == 0
    assert (target / "deep_ep" / alias.MARKER).is_file()
    assert alias.main(["uninstall", "--target", str(target)]) == 0
    assert target.is_dir() and not (target / "deep_ep").exists()
