"""The README, the package metadata and the command help say what the code does (issue 15, item 11)."""

import re

import pytest

from conftest import REPO

tomllib = pytest.importorskip("tomllib")          # Python 3.11+
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
README = (REPO / "README.md").read_text(encoding="utf-8")


def requirement_names(requirements) -> set:
    return {re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_the_app_extra_holds_what_packaging_build_sh_needs():
    # build.sh installs lnn with --no-build-isolation, so the build system's own requirements must be installed
    assert "--no-build-isolation" in (REPO / "packaging" / "build.sh").read_text(encoding="utf-8")
    app = requirement_names(PYPROJECT["project"]["optional-dependencies"]["app"])
    assert requirement_names(PYPROJECT["build-system"]["requires"]) <= app
    assert "pyinstaller" in app
    # the app's Phones menu runs lnn-serve: a bundle built from `pip install '.[app]'` holds it
    assert "lnn[serve]" in PYPROJECT["project"]["optional-dependencies"]["app"]


def test_the_cuda_extra_is_the_cupy_build_the_gpu_figures_were_measured_with():
    cuda = requirement_names(PYPROJECT["project"]["optional-dependencies"]["cuda"])
    measured = set(re.findall(r"\b(cupy-cuda\d+x)\b", (REPO / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")))
    assert measured and {name for name in cuda if name.startswith("cupy")} == measured
    assert cuda - measured == {"ml_dtypes"}          # bfloat16's dtype for amp bf16, the extra's one other package
    assert "CUDA 13" in README and "cupy-cuda13x" in README


def test_tools_package_lists_every_command():
    import lnn.tools

    for command in PYPROJECT["project"]["scripts"]:
        assert re.search(rf"^\s+{command}\s", lnn.tools.__doc__, flags=re.MULTILINE), command


def test_every_lnn_train_line_in_the_readme_names_the_required_out_and_mnist_is_sourced():
    lines = [line for line in README.splitlines() if "lnn-train " in line]
    assert lines and all("--out" in line for line in lines), lines
    assert "t10k-images-idx3-ubyte.gz" in README and "yann.lecun.com" in README


def test_lnn_train_help_speaks_of_validation_accuracy_and_of_numpy():
    from lnn.tools.train import build_parser

    text = build_parser().format_help()
    assert "test accuracy" not in text and "validation accuracy" in " ".join(text.split())
    assert "numpy" in text and "cpu is another name for numpy" in " ".join(text.split())


def test_a_test_without_the_shared_data_says_what_it_needs_and_how_to_point_at_it():
    import conftest

    with pytest.raises(pytest.skip.Exception) as info:
        conftest.need(conftest.SHARED / "data" / "mnist" / "no-such-file.gz")
    message = str(info.value)
    assert "MNIST IDX files" in message and "LNN_SHARED" in message and "data/mnist/no-such-file.gz" in message


def test_benchmarks_describe_threads_as_the_backend_uses_them():
    text = (REPO / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert "is the BLAS thread count for lnn" not in text and "split into N parts of the batch" in text
