"""No silent skips in CI: a test that needs the game or another installed dependency skips without it, and
fails instead under CI=true (the rule in conftest.py, run here on a copy of it in an inner pytest run)."""

import os

pytest_plugins = ("pytester",)

TESTS = os.path.dirname(os.path.abspath(__file__))

NEEDS = '''
import pytest
from conftest import require_module

@pytest.mark.game
def test_needs_the_game():
    pass

def test_needs_a_package():
    require_module("histeve_no_such_package", "pip install histeve-no-such-package")

def test_needs_nothing():
    pass
'''


def test_missing_game_or_package_skips_locally_and_fails_under_ci(pytester, monkeypatch):
    from histeve_jax.envs.luanti import process

    monkeypatch.setattr(process, "MINETEST_BIN", "/nonexistent/minetest")  # the game is "not installed"
    pytester.makeconftest(open(os.path.join(TESTS, "conftest.py")).read())
    pytester.makepyfile(test_needs=NEEDS)
    pytester.makeini("[pytest]\nmarkers =\n    game: needs the game\n")
    monkeypatch.delenv("CI", raising=False)
    args = ("-p", "no:cacheprovider", "--assert=plain")
    pytester.runpytest_inprocess(*args).assert_outcomes(passed=1, skipped=2)
    monkeypatch.setenv("CI", "true")
    # The game check runs in the setup hook, so pytest reports its failure as an error: the run fails.
    result = pytester.runpytest_inprocess(*args)
    result.assert_outcomes(passed=1, failed=1, errors=1)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*CI=true but minetest or Xvfb not installed*",
                                 "*CI=true but the histeve_no_such_package package is not installed*"])


def test_installed_minestudio_is_the_version_install_sh_pins():
    """MineStudio is the action-space oracle: the tests run against the version launch/install.sh installs."""
    import importlib.metadata
    import re

    text = open(os.path.join(os.path.dirname(TESTS), "launch", "install.sh")).read()
    pin = re.search(r"^MINESTUDIO_VERSION=(\S+)$", text, re.M)
    assert pin and '"minestudio==$MINESTUDIO_VERSION"' in text
    assert importlib.metadata.version("minestudio") == pin.group(1)
