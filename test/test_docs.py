"""The README's first code block is the project's front door: one install command, one serve
command, one test command, and CI (.ci/run) runs the install and test commands verbatim."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"```bash\n(.*?)```", f.read(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_install_serve_test():
    install, serve, test = readme_commands()
    assert "pip install " in install and "torch==2.13.0" in install and "sglang==" in install
    assert serve == "python -m sgl_kvxfer.launch_server"
    assert test.startswith("python -m pytest test")


def test_ci_runs_the_readme_install_and_test_commands_verbatim():
    install, _, test = readme_commands()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [line.strip() for line in f]
    assert any(line == install or line.startswith(install + " ||") for line in lines), install
    assert test in lines, test
