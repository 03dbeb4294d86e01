"""Which NUMA node each local rank's GPU is attached to, read from sysfs by PCI address.

A GPU's DMA and its host-side threads (the data loader, the kernel launches) run fastest from
the CPUs and memory of the socket its PCIe root sits on; ``/sys/bus/pci/devices/ADDR/numa_node``
names that node, or -1 where the platform does not say (single-socket hosts, many VMs). The
addresses come from the rank's own CUDA context (``launcher.group.process_group``); reading
them here needs no torch and no communication: O(GPUs) small files per rank.
"""

from __future__ import annotations

from pathlib import Path

_PCI = Path("/sys/bus/pci/devices")


def pci_address(domain: int, bus: int, device: int) -> str:
    """sysfs's name of a GPU (``0000:c1:00.0``): CUDA gives domain, bus and device, and an
    NVIDIA GPU is function 0 of its device."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def numa_node(address: str, root: Path = _PCI) -> int | None:
    """The NUMA node of the PCI device ``address``; None where sysfs does not know (-1, no
    such device)."""
    try:
        node = int((root / address.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def local_gpu_nodes(addresses: list[str], local_size: int,
                    root: Path = _PCI) -> tuple[int | None, ...]:
    """The NUMA node of each local rank's GPU, ``addresses`` being the visible GPUs in CUDA's
    order (local rank r drives visible GPU r: ``launcher.placement.env.local_device_index``).
    () where fewer GPUs are visible than ranks: each rank then sees one GPU as device 0
    (``srun --gpus-per-task=1``) or all share it, and which it is, and where the other ranks'
    GPUs sit, cannot be told without asking them."""
    if len(addresses) < local_size:
        return ()
    return tuple(numa_node(address, root) for address in addresses[:local_size])
