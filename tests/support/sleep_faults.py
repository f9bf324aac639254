"""A worker extension (``--worker-extension-cls tests.support.sleep_faults.SleepFaults``) that
makes the next sleep or wake fail at one allocation, as it can on an NPU: a backup copy that
fails (pyACL's ``aclrtMemcpy`` once pinned host memory runs out), an unmap that fails, or a
restore that fails on waking. Reached
through ``/collective_rpc``; the allocator under it is the real one."""

from __future__ import annotations

from vllm_ascend_rl.sleep.allocator import PERSISTENT_TAG, CaMemAllocator


class SleepFaults:
    def sleep_victims(self) -> dict[str, int]:
        """What a sleep releases now, by tag (the allocations it goes through in order)."""
        counts: dict[str, int] = {}
        for alloc in CaMemAllocator.get_instance().allocations.values():
            if alloc.mapped and alloc.tag != PERSISTENT_TAG:
                counts[alloc.tag] = counts.get(alloc.tag, 0) + 1
        return counts

    def fail_next_sleep(self, step: str, at: int) -> None:
        """The next sleep's ``at``-th (from 0) backup (``step="backup"``) or unmap
        (``"unmap"``), or the next wake's restore of a backup (``"restore"``), fails, once."""
        allocator = CaMemAllocator.get_instance()
        calls = [0]
        if step in ("backup", "restore"):
            method = f"_{'back_up' if step == 'backup' else 'restore'}"
            real = getattr(allocator, method)

            def failing(alloc):
                calls[0] += 1
                if calls[0] == at + 1:
                    delattr(allocator, method)
                    raise RuntimeError("aclrtMemcpy failed with ACL error 207001 (injected)")
                return real(alloc)

            setattr(allocator, method, failing)
            return
        vmm = allocator.vmm

        class FailingUnmap:
            def __getattr__(self, name):
                return getattr(vmm, name)

            def table_unmap(self, *args):
                calls[0] += 1
                if calls[0] == at + 1:
                    allocator.vmm = vmm
                    raise vmm.VmmError(16, "Device or resource busy (injected)", "host.unmap")
                return vmm.table_unmap(*args)

        allocator.vmm = FailingUnmap()
