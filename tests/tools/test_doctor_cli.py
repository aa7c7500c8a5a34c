"""lnn-doctor: a backend asked for by name that does not load is FAIL with the reason and exit 1,
an absent one SKIP; the NumPy check passes here."""

import os
import subprocess
import sys

from cli_helpers import run_command


def doctor(**environment):
    env = {key: value for key, value in os.environ.items() if key != "LNN_CPU_KERNELS"}
    env.update(environment)
    return subprocess.run([sys.executable, "-m", "lnn.tools.doctor"], capture_output=True, text=True, env=env,
                          timeout=300)


def lines_of(result) -> dict:
    return {line.split()[0]: line for line in result.stdout.splitlines()}


def test_a_misconfigured_cpu_kernel_choice_fails_with_the_reason():
    result = doctor(LNN_CPU_KERNELS="bogus")
    assert result.returncode == 1, result.stdout
    line = lines_of(result)["numba"]
    assert line.split()[1] == "FAIL" and "LNN_CPU_KERNELS=bogus" in line and "must be jit or aot" in line
    assert lines_of(result)["numpy"].split()[1] == "PASS"
    assert "Traceback" not in result.stderr


def test_the_numpy_check_passes_and_absent_backends_skip():
    result = run_command("doctor")
    assert lines_of(result)["numpy"].split()[1] == "PASS"
    assert all(line.split()[1] in ("PASS", "SKIP") for line in lines_of(result).values()), result.stdout
    assert result.returncode == 0
