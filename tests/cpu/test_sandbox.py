"""The python tool's sandbox (bubblewrap): useful code still runs; the code's own failures, time-outs and output are
observations the policy reads; a sandbox that cannot run refuses to start, naming the cause and the flag. Needs
`bwrap` (Debian package bubblewrap; CI installs it).
"""

import asyncio
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

from megatron_rl.config.arguments import build_parser
from megatron_rl.tools import EnvironmentFailure, SandboxLimits, SandboxUnavailable, ToolSet, built_in_tools, run_python
from megatron_rl.tools.sandbox import bwrap
from megatron_rl.tools.sandbox.process import run_contained

pytestmark = pytest.mark.timeout(120)

CAP = SandboxLimits().max_output_bytes


# ---- useful code ----------------------------------------------------------------------------------------------------

def _run(code: str, **limits):
    return asyncio.run(run_python(code, SandboxLimits(**{"timeout_s": 5, "memory_mb": 512, **limits})))


def test_useful_code_runs_with_the_standard_library_and_a_work_directory():
    code = ("import math, fractions, json, itertools, decimal, statistics, re, collections\n"
            "print(math.factorial(20), fractions.Fraction(1, 3) + fractions.Fraction(1, 6))\n"
            "print(json.dumps(list(itertools.islice(itertools.count(), 3))), statistics.mean([1, 2, 3, 4]))\n"
            "open('data.txt', 'w').write('é' * 3)\nprint(open('data.txt').read(), os.getcwd())\n")
    result = _run("import os\n" + code)
    assert (result.text, result.is_error) == ("2432902008176640000 1/2\n[0, 1, 2] 2.5\nééé /tmp\n", False)
    assert _run("import os\nprint(os.listdir('.'))").text == "[]\n", "each call has a fresh work directory"


def test_the_codes_own_failure_is_an_error_the_policy_reads():
    assert _run("print('partial')\n1 / 0").text == ("partial\nZeroDivisionError: division by zero\n"
                                                    "error: the code exited with status 1")
    assert _run("import sys\nsys.exit(4)").text == "error: the code exited with status 4"
    assert _run("x = bytearray(10 * 2**30)").text.startswith("MemoryError: the code used more than 512 MiB")
    long = _run("print('z' * 5000)", max_output_chars=100).text
    assert long == "z" * 100 + "\n... (4901 more characters)"


def test_output_before_a_time_out_is_kept():
    result = _run("print('started')\nwhile True:\n    pass", timeout_s=1)
    assert (result.text, result.is_error) == ("started\nerror: the code ran longer than 1 s and was stopped", True)


# ---- a sandbox that cannot run --------------------------------------------------------------------------------------

def test_a_sandbox_that_never_gets_ready_is_the_environments_failure():
    command = lambda fd: [sys.executable, "-c", "import sys\nprint('no sandbox here')\nsys.exit(70)"]
    with pytest.raises(EnvironmentFailure, match="exited with status 70 before it was ready.*no sandbox here"):
        asyncio.run(run_contained(command, "print(1)", 5, CAP, env={}))


def test_without_bubblewrap_the_tool_refuses_to_start_naming_the_package_and_the_flag(tmp_path, monkeypatch):
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap is not installed.*apt-get install -y bubblewrap.*"
                                                 r"--python-sandbox weak"):
        bwrap.check(None)
    bwrap.ensure.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
            ToolSet(built_in_tools(["calculator", "python"]))
        assert ToolSet(built_in_tools(["calculator"])).schemas, "a run without the python tool needs no bwrap"
        assert ToolSet(built_in_tools(["python"]), python_sandbox="weak").schemas
    finally:
        bwrap.ensure.cache_clear()


def test_with_user_namespaces_blocked_the_tool_refuses_naming_the_kernel_setting_and_the_flag():
    """A user namespace whose user.max_user_namespaces is 0: what a machine or container that blocks them does."""
    check = "from megatron_rl.tools.sandbox import bwrap\nbwrap.ensure()"
    script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c '{check}'"
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert done.returncode == 1
    assert re.search(r"SandboxUnavailable: --python-sandbox bwrap: bubblewrap cannot create its namespaces here "
                     r"\(bwrap: Creating new namespace failed.*user\.max_user_namespaces = 0.*--privileged.*"
                     r"--python-sandbox weak", done.stderr), done.stderr


def test_the_flag_takes_the_sandboxes_by_name():
    assert build_parser().parse_args(["--python-sandbox", "weak"]).python_sandbox == "weak"
    assert build_parser().parse_args([]).python_sandbox == "bwrap"
