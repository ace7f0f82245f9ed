"""The attention kernel backends, as every layer but the kernel code sees them: one registry
entry per backend holding its name (a value of `train.attention_kernel`), the device it runs
on, whether it takes packed documents in one variable-length call, the optional package it
needs and how `auto` ranks it. Validation, the device rules, `lctrain train`'s host checks and
the GPU check ask the entry instead of comparing names.

The code of a backend (its dense and variable-length kernels, the forward ops selective
checkpointing keeps, whether its package imports) is registered under the same name in
`lctrain.attention.kernels`; docs/extending.md is the checklist for adding one. This module
imports nothing from lctrain but the registry: it sits in the config layer, so that the schema
reads its names (`one_of("auto", registry=KERNEL_BACKENDS)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lctrain.config.registry import Registry

FLASH_INSTALL = ("pip install flash-attn --no-build-isolation (after torch; or the prebuilt wheel "
                 "matching your torch, CUDA and Python from the flash-attention releases)")


@dataclass(frozen=True)
class KernelBackend:
    name: str
    """The value of train.attention_kernel that selects it."""
    device: str
    """cpu | cuda: the only device it runs on (validation refuses it on the other); any: every
    device (a linear-attention kernel in plain torch)."""
    summary: str
    """One line for `lctrain keys` and the docs."""
    varlen: bool = False
    """Packed documents in one variable-length call per kind and block pair (else one call per
    document)."""
    package: str | None = None
    """The optional package it imports (None: torch alone)."""
    install: str | None = None
    """How to install `package`, for the error that names it."""
    auto_rank: int | None = None
    """`auto` picks, on its device, the installed backend of the lowest rank (None: never)."""


KERNEL_BACKENDS: Registry[KernelBackend] = Registry("attention kernel backend")
for _backend in (
        KernelBackend("torch", "cuda", "CUDA: PyTorch's built-in flash attention, no extra package",
                      varlen=True, auto_rank=1),
        KernelBackend("flash_attn", "cuda", "CUDA: the flash-attn package, the `gpu` extra",
                      varlen=True, package="flash-attn", install=FLASH_INSTALL, auto_rank=0),
        KernelBackend("cpu", "cpu", "CPU: PyTorch's CPU flash-attention op", auto_rank=0),
        KernelBackend("reference", "cpu", "CPU: a plain-torch varlen kernel, for checks",
                      varlen=True)):
    KERNEL_BACKENDS.add(_backend)


FLA_INSTALL = ("pip install flash-linear-attention (the `gpu` extra: pip install 'lctrain[gpu]'; "
               "needs Triton and a CUDA GPU)")

LINEAR_KERNELS: Registry[KernelBackend] = Registry("linear-attention kernel")
"""The gated delta rule's backends (`train.linear_kernel`), device `any` for one that runs on
every device; their code is registered under the same names in
`lctrain.attention.delta_rule` (`DELTA_RULES`)."""
for _backend in (
        KernelBackend("torch", "any", "any device: lctrain's chunked gated delta rule in plain "
                      "torch", auto_rank=1),
        KernelBackend("fla", "cuda", "CUDA: flash-linear-attention's Triton kernels, the `gpu` "
                      "extra", package="flash-linear-attention", install=FLA_INSTALL,
                      auto_rank=0)):
    LINEAR_KERNELS.add(_backend)


def kernel_backend(name: str) -> KernelBackend:
    """The registered backend called `name` (KeyError naming the registered ones)."""
    return KERNEL_BACKENDS[name]


def backends_on(device: str) -> tuple[str, ...]:
    """The registered backends that run on `device` (cpu | cuda), in registration order."""
    return tuple(n for n in KERNEL_BACKENDS if KERNEL_BACKENDS[n].device == device)
