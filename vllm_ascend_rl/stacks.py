"""The Ascend software stacks the plugin supports, one per vllm-ascend release: the table the
README's support matrix, ``docs/ascend-conformance.md`` §1 (with each value's source), the doctor
and the torch_npu build check read (``tests/unit/test_stacks.py`` keeps the documents equal)."""

from __future__ import annotations

from typing import NamedTuple


class Stack(NamedTuple):
    vllm_ascend: str
    vllm: str
    pythons: tuple[str, ...]
    torch_npu: tuple[str, ...]  # every build the release pins (requirements, image)
    cann: str

    @property
    def name(self) -> str:
        return (
            f"vllm-ascend {self.vllm_ascend} + vLLM {self.vllm} + torch_npu "
            f"{' or '.join(self.torch_npu)} + CANN {self.cann} on Python {'/'.join(self.pythons)}"
        )


SUPPORTED = (
    Stack("0.32.0rc1", "0.32.0", ("3.11", "3.12"), ("2.10.0.post7",), "9.2"),
    Stack("0.30.0", "0.30.0", ("3.10", "3.11", "3.12"), ("2.10.0.post4", "2.10.0.post7"), "9.2.1"),
)


def mismatch(vllm: str, python: str, vllm_ascend: str | None = None) -> str | None:
    """What of this combination no supported stack has (None: one has all of it). A local
    version tag (``+cpu``) is ignored; ``vllm_ascend`` None (a CPU host) is not compared."""
    stack = next((s for s in SUPPORTED if s.vllm == vllm.split("+")[0]), None)
    if stack is None:
        return f"vLLM {vllm} is in no supported stack"
    if python not in stack.pythons:
        return f"vLLM {stack.vllm} on Python {python} (its stack: {', '.join(stack.pythons)})"
    if vllm_ascend is not None and vllm_ascend.split("+")[0] != stack.vllm_ascend:
        return f"vllm-ascend {vllm_ascend} with vLLM {stack.vllm} (its stack: {stack.vllm_ascend})"
    return None


def markdown() -> str:
    """The support matrix, as the README and the conformance record print it."""
    rows = [
        (s.vllm_ascend, s.vllm, *map(", ".join, (s.pythons, s.torch_npu)), s.cann)
        for s in SUPPORTED
    ]
    head = [("vllm-ascend", "vLLM", "Python", "torch_npu", "CANN"), ("---",) * 5]
    return "\n".join("| " + " | ".join(row) + " |" for row in head + rows)
