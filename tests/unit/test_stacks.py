"""One table of supported stacks (``vllm_ascend_rl.stacks``): the README and the conformance
record print it as it is, and the doctor judges an install by it."""

from __future__ import annotations

import sys

import pytest

from tests.support.torch_npu_wheel import ROOT
from vllm_ascend_rl import stacks
from vllm_ascend_rl.doctor import local


@pytest.mark.parametrize("document", ["README.md", "docs/ascend-conformance.md"])
def test_the_documents_print_the_table_as_it_is(document):
    assert stacks.markdown() in (ROOT / document).read_text()


def doctor_verdict(monkeypatch, vllm: str, python: tuple[int, int], ascend: str | None):
    versions = {"vllm": vllm, "vllm_ascend": ascend}
    monkeypatch.setattr(local, "_version", versions.get)
    monkeypatch.setattr(sys, "version_info", (*python, 0))
    return local.supported_stack(ascend)


@pytest.mark.parametrize("stack", stacks.SUPPORTED, ids=lambda s: s.vllm_ascend)
@pytest.mark.parametrize("on_npu", [True, False], ids=["npu", "cpu"])
def test_the_doctor_passes_each_supported_stack(monkeypatch, stack, on_npu):
    ascend = stack.vllm_ascend if on_npu else None
    for python in stack.pythons:
        major, minor = map(int, python.split("."))
        check = doctor_verdict(monkeypatch, f"{stack.vllm}+cpu", (major, minor), ascend)
        assert check.status == "ok", check


@pytest.mark.parametrize(
    "vllm, python, ascend, problem",
    [
        ("0.27.1", (3, 11), None, "vLLM 0.27.1 is in no supported stack"),
        ("0.32.0", (3, 10), None, "vLLM 0.32.0 on Python 3.10 (its stack: 3.11, 3.12)"),
        ("0.32.0", (3, 12), "0.30.0", "vllm-ascend 0.30.0 with vLLM 0.32.0 (its stack: 0.32.0rc1)"),
    ],
)
def test_the_doctor_names_the_supported_stacks_for_any_other(
    monkeypatch, vllm, python, ascend, problem
):
    check = doctor_verdict(monkeypatch, vllm, python, ascend)
    assert check.status == "warn" and problem in check.found, check
    for stack in stacks.SUPPORTED:
        assert stack.name in check.fix
