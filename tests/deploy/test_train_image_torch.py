"""The train image's torch install line, run for real outside Docker.

The Dockerfile's ``RUN pip install ... "$TORCH_SPEC"`` line is taken from the file and run by
``sh`` with the build arguments as environment variables (as Docker passes ARGs to RUN), with
``pip`` a shim that installs into a temporary directory: against a fake PEP 503 index on disk
holding a fake ``torch`` wheel, the index option must reach pip apart from the requirement
(the round-1 line quoted them together: "torch==2.13.0 --index-url ..." is not a requirement).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dockerfile_args() -> dict[str, str]:
    """The train stage's ARG defaults."""
    train = (ROOT / "Dockerfile").read_text().split("AS train", 1)[1]
    return dict(re.findall(r"^ARG (\w+)=(.*)$", train, flags=re.M))


def torch_install_line() -> str:
    lines = [
        line.removeprefix("RUN ").strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("RUN pip install") and "TORCH_SPEC" in line
    ]
    assert len(lines) == 1, lines
    return lines[0]


def fake_index(root: Path, version: str) -> str:
    """A file:// simple index with one wheel, torch-<version>-py3-none-any."""
    wheel = f"torch-{version}-py3-none-any.whl"
    package = root / "simple" / "torch"
    package.mkdir(parents=True)
    dist_info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(package / wheel, "w") as z:
        z.writestr("torch/__init__.py", f"__version__ = {version!r}\nFAKE = True\n")
        z.writestr(
            f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
        )
        z.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(
            f"{dist_info}/RECORD",
            f"torch/__init__.py,,\n{dist_info}/METADATA,,\n{dist_info}/WHEEL,,\n"
            f"{dist_info}/RECORD,,\n",
        )
    (package / "index.html").write_text(f'<html><body><a href="{wheel}">{wheel}</a></body></html>')
    return (root / "simple").as_uri()


def run_line(tmp_path: Path, env: dict[str, str], pip_body: str) -> subprocess.CompletedProcess:
    shims = tmp_path / "bin"
    shims.mkdir()
    pip = shims / "pip"
    pip.write_text("#!/bin/sh\n" + pip_body)
    pip.chmod(0o755)
    return subprocess.run(
        ["sh", "-c", torch_install_line()],
        # no pip configuration of this machine (a find-links to a local torch, a mirror)
        env={"PATH": f"{shims}:/usr/bin:/bin", "PIP_CONFIG_FILE": os.devnull, **env},
        capture_output=True,
        text=True,
    )


def test_default_build_arguments_pick_the_cpu_wheel_index():
    args = dockerfile_args()
    assert args["TORCH_SPEC"] == "torch==2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_the_install_line_installs_the_spec_from_the_index_it_is_given(tmp_path):
    index = fake_index(tmp_path / "index", "2.13.0+cpu")
    target = tmp_path / "site"
    result = run_line(
        tmp_path,
        {"TORCH_SPEC": "torch==2.13.0", "TORCH_INDEX_URL": index},
        f'exec {sys.executable} -m pip "$@" --target {target} --no-deps '
        "--disable-pip-version-check --quiet\n",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    installed = (target / "torch" / "__init__.py").read_text()
    assert "2.13.0+cpu" in installed and "FAKE = True" in installed


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        ("", ["install", "--no-cache-dir", "torch==2.13.0"]),  # CUDA variant: PyPI
        (
            "https://mirror.example/simple with space",
            [
                "install",
                "--no-cache-dir",
                "--index-url",
                "https://mirror.example/simple with space",
                "torch==2.13.0",
            ],
        ),
    ],
)
def test_the_index_reaches_pip_as_its_own_argument(tmp_path, index, expected):
    record = tmp_path / "argv"
    result = run_line(
        tmp_path,
        {"TORCH_SPEC": "torch==2.13.0", "TORCH_INDEX_URL": index},
        f'for a in "$@"; do printf "%s\\n" "$a"; done > {record}\n',
    )
    assert result.returncode == 0, result.stderr
    assert record.read_text().splitlines() == expected
